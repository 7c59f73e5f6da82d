"""``SessionRouterClient``: one method per RPC of WorkerService and SessionService.

Methods take and return the dataclasses of ``sessionrouter.client.types``; failures raise the
``SessionRouterError`` hierarchy. Unary calls share one path (``_unary``): the caller's
metadata, one overall deadline, and UNAVAILABLE retried under the client's ``RetryPolicy``
(every unary call here is idempotent; see ``_retry``). Streams are not retried as a whole:
the feed reconnects and resumes from its cursor, for as long as the caller wants. Against a
sharded router each call goes to the shard that owns its group (``_shards``), and reward
batches are split by shard (``_shard_rewards``).

The methods come in groups, one module each: ``_unary_calls`` (how a call is made),
``_worker_calls``, ``_session_calls``, ``_feed_calls`` and ``_reward_calls``; this module
builds the client (channels, routing, metadata, retries) and closes it.
"""

# `timeout=` on these coroutines is the gRPC deadline, sent to the router and shared by the
# retries of one call; `asyncio.timeout` around the call could not do either (ASYNC109).

from __future__ import annotations

from collections.abc import (
    Callable,
    Sequence,
)
from types import TracebackType
from typing import Any, Self

import grpc

from sessionrouter.client._retry import Retrier, RetryPolicy
from sessionrouter.client._reward_calls import RewardCalls, Rollout
from sessionrouter.client._shards import ShardRouting, ShardStubs
from sessionrouter.client._worker_calls import WorkerCalls
from sessionrouter.client.shardmap import shard_of

__all__ = ["Rollout", "SessionRouterClient"]

DEFAULT_TIMEOUT = 30.0
"""Seconds a unary call may take by default, retries and their waits included."""


_CHANNEL_DEFAULTS: tuple[tuple[str, int], ...] = (("grpc.max_reconnect_backoff_ms", 5_000),)
"""Channel arguments ``connect`` sets unless its caller gives them."""


class SessionRouterClient(WorkerCalls, RewardCalls):
    """Asyncio client for a sessionrouter: one router, or N shards.

    Build it with ``SessionRouterClient.connect(target)`` (the client then owns and closes its
    channel) or around a ``grpc.aio.Channel`` you manage. Use it as an async context manager,
    or call ``close()``.

    Args:
        channel: the channel to call through; or one channel per shard, in shard order (a
            sharded router: each call goes to the shard that owns its group).
        token: sent as ``authorization: Bearer <token>`` on every call. Sent as plain metadata,
            so it also works on an insecure channel; use TLS outside a trusted network.
        metadata: extra ``(key, value)`` pairs sent on every call.
        default_timeout: seconds a unary call may take when the call gives no ``timeout``;
            ``None`` for no deadline. Streams have no default deadline.
        retry_policy: how transient errors (UNAVAILABLE, a reset stream) are retried: unary
            calls, and the backoff of feed reconnects.
        owns_channel: close ``channel`` when the client closes (``connect`` sets it).
        shard_count: N, when ``channel`` is one proxy in front of N shards (nginx hashing
            ``x-group-id``): every call naming a group then carries that header.
        addresses: the address of each channel, to recognise the owner a ``WRONG_SHARD``
            refusal names.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel | Sequence[grpc.aio.Channel],
        *,
        token: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        default_timeout: float | None = DEFAULT_TIMEOUT,
        retry_policy: RetryPolicy | None = None,
        owns_channel: bool = False,
        shard_count: int | None = None,
        addresses: Sequence[str] = (),
        _open_channel: Callable[[str], grpc.aio.Channel] | None = None,
    ) -> None:
        channels = list(channel) if isinstance(channel, Sequence) else [channel]
        if addresses and len(addresses) != len(channels):
            raise ValueError(f"{len(addresses)} addresses for {len(channels)} channels")
        names = list(addresses) or [""] * len(channels)
        self._channels = channels
        self._owns_channel = owns_channel
        open_stubs = None
        if _open_channel is not None:
            opener = _open_channel

            def open_stubs(address: str) -> ShardStubs:
                return ShardStubs.over(opener(address), address)

        self._routing = ShardRouting(
            [ShardStubs.over(c, a) for c, a in zip(channels, names, strict=True)],
            shard_count=shard_count,
            open_stubs=open_stubs,
        )
        auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._metadata: tuple[tuple[str, str], ...] = (*auth, *metadata)
        self._default_timeout = default_timeout
        self._retrier = Retrier(retry_policy or RetryPolicy())

    @classmethod
    def connect(
        cls,
        target: str | Sequence[str],
        *,
        shard_count: int | None = None,
        token: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        default_timeout: float | None = DEFAULT_TIMEOUT,
        retry_policy: RetryPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        root_certificates: bytes | None = None,
        client_certificate_chain: bytes | None = None,
        client_private_key: bytes | None = None,
    ) -> SessionRouterClient:
        """Opens a channel to ``target`` (``host:port``); TLS when ``credentials`` are given.

        A sharded router: ``target`` is the list of the shards' addresses in shard order (one
        channel each; a call naming a group goes to its owner, the others round-robin), or one
        proxy address with ``shard_count=N`` (one channel; a call naming a group carries it in
        ``x-group-id``, which the proxy's shard map hashes).

        The connection is made lazily, on the first call. ``options`` are gRPC channel
        arguments, for example ``[("grpc.keepalive_time_ms", 30_000)]``. Unless they say
        otherwise, the channel's own reconnect backoff is capped at 5 s (gRPC's default grows
        to 120 s), so a channel notices a restarted router about as soon as the retries do.

        Instead of ``credentials``, TLS can be given as PEM bytes: ``root_certificates`` (the
        CA that signed the router's certificate; the system roots when omitted) and, for a
        router that requires client certificates (mTLS), ``client_certificate_chain`` with
        ``client_private_key``. ``token`` picks the role the router grants (worker, rollout,
        trainer or admin); a certificate only opens the connection.
        """
        pem = (root_certificates, client_certificate_chain, client_private_key)
        if any(p is not None for p in pem):
            if credentials is not None:
                raise ValueError("give credentials or PEM certificates, not both")
            if (client_certificate_chain is None) != (client_private_key is None):
                raise ValueError("a client certificate needs its private key, and the reverse")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=root_certificates,
                private_key=client_private_key,
                certificate_chain=client_certificate_chain,
            )
        given = {name for name, _ in options}
        channel_options = list(options) + [
            (name, value) for name, value in _CHANNEL_DEFAULTS if name not in given
        ]

        def open_channel(address: str) -> grpc.aio.Channel:
            if credentials is None:
                return grpc.aio.insecure_channel(address, options=channel_options)
            return grpc.aio.secure_channel(address, credentials, options=channel_options)

        addresses = [target] if isinstance(target, str) else list(target)
        if not isinstance(target, str) and shard_count is not None:
            raise ValueError("shard_count is for one proxy address; a shard list gives N itself")
        if not addresses:
            raise ValueError("at least one router address is needed")
        if shard_count is not None:
            shard_of("", shard_count)  # refuses a count out of range before any channel opens
        return cls(
            [open_channel(a) for a in addresses],
            token=token,
            metadata=metadata,
            default_timeout=default_timeout,
            retry_policy=retry_policy,
            owns_channel=True,
            shard_count=shard_count,
            addresses=addresses,
            _open_channel=open_channel,
        )

    @property
    def shard_count(self) -> int:
        """N for a sharded router; 1 for one unsharded router."""
        return self._routing.count

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channels if this client opened them (``connect``)."""
        await self._routing.close_extra()
        if self._owns_channel:
            for channel in self._channels:
                await channel.close()
