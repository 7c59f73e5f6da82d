"""``SessionRouterClient``: one method per RPC of WorkerService and SessionService.

Methods take and return the dataclasses of ``sessionrouter.client.types``; failures raise the
``SessionRouterError`` hierarchy. Unary calls share one path (``_unary``): the caller's
metadata, one overall deadline, and UNAVAILABLE retried under the client's ``RetryPolicy``
(every unary call here is idempotent; see ``_retry``). Streams are not retried as a whole:
the feed reconnects and resumes from its cursor, for as long as the caller wants. Against a
sharded router each call goes to the shard that owns its group (``_shards``), and reward
batches are split by shard (``_shard_rewards``).

It is over 500 lines because it is the public surface, one method per RPC with its typed
parameters and docstring; the logic behind them lives in ``_retry``, ``_feed`` and ``_rewards``.
"""

# `timeout=` on these coroutines is the gRPC deadline, sent to the router and shared by the
# retries of one call; `asyncio.timeout` around the call could not do either (ASYNC109).

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc

from sessionrouter.client import _convert
from sessionrouter.client._errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    OutOfRangeError,
    SessionRouterError,
)
from sessionrouter.client._feed import (
    FeedRetryHook,
    FeedSkipHook,
    batches_of,
    follow_feed,
    groups_of,
)
from sessionrouter.client._retry import Retrier, RetryPolicy
from sessionrouter.client._rewards import ReplacementHook, RewardStream
from sessionrouter.client._shard_rewards import (
    ShardedRewardStream,
    split_by_shard,
    wrong_shard_owner,
)
from sessionrouter.client._shards import Route, ShardRouting, ShardStubs
from sessionrouter.client.shardmap import shard_of
from sessionrouter.client.types import (
    DeregisterWorkerResult,
    Group,
    GroupOptions,
    GroupResult,
    GroupState,
    Page,
    PlacementMode,
    RegisterWorkerResult,
    ResultBatch,
    RewardResult,
    RewardStatus,
    Session,
    StalenessPolicy,
    StartGroupResult,
    StartSessionResult,
    SubmitRewardsResult,
    TrainerState,
    WeightUpdate,
    Worker,
)
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb

__all__ = ["Rollout", "SessionRouterClient"]

_log = logging.getLogger("sessionrouter.client")

Req = TypeVar("Req")
Resp = TypeVar("Resp")

Rollout = Callable[[Session], Awaitable[float]]
"""A trainer's rollout: runs one session on ``session.worker_address``, returns its reward."""

DEFAULT_TIMEOUT = 30.0
"""Seconds a unary call may take by default, retries and their waits included."""


_CHANNEL_DEFAULTS: tuple[tuple[str, int], ...] = (("grpc.max_reconnect_backoff_ms", 5_000),)
"""Channel arguments ``connect`` sets unless its caller gives them."""


class SessionRouterClient:
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

    async def _unary(
        self,
        method: Callable[[ShardStubs], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
        request: Req,
        timeout: float | None,
        route: Route | None = None,
    ) -> Resp:
        """One unary call on ``route`` (the next shard when None), retried while transient;
        a ``WRONG_SHARD`` refusal is followed once to the owner it names."""
        route = route or self._routing.any()
        budget = self._default_timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            return await self._unary_on(route, method, request, budget)
        except FailedPreconditionError as error:
            owner = self._routing.owner_of(error, route)
            if owner is None:
                raise
            _log.warning("%s; following it to %s", error, owner.stubs.address or owner.shard)
            left = None if budget is None else max(0.0, budget - (time.monotonic() - started))
            return await self._unary_on(owner, method, request, left)

    async def _broadcast(
        self,
        method: Callable[[ShardStubs], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
        request: Req,
        timeout: float | None,
    ) -> list[Resp]:
        """The same call on every shard, concurrently; the replies in shard order. For state
        each shard keeps for itself (trainer state, weight updates); one call when unsharded."""
        routes = [self._routing.shard(i) for i in range(self._routing.count)]
        return list(
            await asyncio.gather(*(self._unary(method, request, timeout, r) for r in routes))
        )

    async def _unary_on(
        self,
        route: Route,
        method: Callable[[ShardStubs], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
        request: Req,
        budget: float | None,
    ) -> Resp:
        call = method(route.stubs)
        metadata = (*self._metadata, *route.headers)

        async def attempt(remaining: float | None) -> Resp:
            return await call(request, timeout=remaining, metadata=metadata)

        return await self._retrier.call(attempt, timeout=budget)

    # WorkerService ------------------------------------------------------------------------

    async def register_worker(
        self,
        worker_id: str,
        address: str,
        capacity: int,
        *,
        labels: Mapping[str, str] | None = None,
        policy_version: int = 0,
        timeout: float | None = None,
    ) -> RegisterWorkerResult:
        """Adds a worker, or updates capacity and labels of a registered one (idempotent).
        ``policy_version`` is the weight version it serves (0: unknown)."""
        request = wpb.RegisterWorkerRequest(
            worker_id=worker_id,
            address=address,
            capacity=capacity,
            labels=dict(labels or {}),
            policy_version=policy_version,
        )
        response = await self._unary(lambda s: s.workers.RegisterWorker, request, timeout)
        return _convert.register_worker_result_from_proto(response)

    async def heartbeat(
        self, worker_id: str, *, policy_version: int = 0, timeout: float | None = None
    ) -> Worker:
        """Tells the router the worker is alive; call well within ``heartbeat_timeout``.
        ``policy_version`` reports the weights it serves now (0: unchanged); the target
        version of a weight update in progress puts the worker back into placement."""
        request = wpb.HeartbeatRequest(worker_id=worker_id, policy_version=policy_version)
        response = await self._unary(lambda s: s.workers.Heartbeat, request, timeout)
        return _convert.worker_from_proto(response.worker)

    async def drain_worker(
        self, worker_id: str, *, resume: bool = False, timeout: float | None = None
    ) -> Worker:
        """Stops placing new sessions on the worker (``resume=True`` restarts it)."""
        request = wpb.DrainWorkerRequest(worker_id=worker_id, resume=resume)
        response = await self._unary(lambda s: s.workers.DrainWorker, request, timeout)
        return _convert.worker_from_proto(response.worker)

    async def deregister_worker(
        self, worker_id: str, *, timeout: float | None = None
    ) -> DeregisterWorkerResult:
        """Removes a worker; its open sessions are marked ``worker_lost``."""
        request = wpb.DeregisterWorkerRequest(worker_id=worker_id)
        response = await self._unary(lambda s: s.workers.DeregisterWorker, request, timeout)
        return _convert.deregister_worker_result_from_proto(response)

    async def get_worker(self, worker_id: str, *, timeout: float | None = None) -> Worker:
        request = wpb.GetWorkerRequest(worker_id=worker_id)
        response = await self._unary(lambda s: s.workers.GetWorker, request, timeout)
        return _convert.worker_from_proto(response.worker)

    async def list_workers(
        self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Page[Worker]:
        """One page of workers ordered by id; ``page_size`` 0 means the server's 100."""
        request = wpb.ListWorkersRequest(page_size=page_size, page_token=page_token)
        response = await self._unary(lambda s: s.workers.ListWorkers, request, timeout)
        return Page(
            items=tuple(_convert.worker_from_proto(w) for w in response.workers),
            next_page_token=response.next_page_token,
        )

    async def iter_workers(
        self, *, page_size: int = 0, timeout: float | None = None
    ) -> AsyncIterator[Worker]:
        """Every worker, fetching pages as needed (``timeout`` applies per page)."""
        token = ""
        while True:
            page = await self.list_workers(page_size=page_size, page_token=token, timeout=timeout)
            for worker in page.items:
                yield worker
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def begin_weight_update(
        self,
        version: int,
        *,
        worker_ids: Sequence[str] = (),
        interrupt_sessions: bool = False,
        timeout: float | None = None,
    ) -> WeightUpdate:
        """Takes the named workers (every worker when none is named) out of placement until
        each serves ``version``. Their open sessions keep running; with
        ``interrupt_sessions`` they are marked interrupted."""
        request = wpb.BeginWeightUpdateRequest(
            version=version, worker_ids=list(worker_ids), interrupt_sessions=interrupt_sessions
        )
        # Every shard places on the whole pool: each takes the workers out of its placement.
        responses = await self._broadcast(lambda s: s.workers.BeginWeightUpdate, request, timeout)
        return WeightUpdate(
            version=version,
            workers=tuple(_convert.worker_from_proto(w) for w in responses[0].workers),
            interrupted_sessions=sum(r.interrupted_sessions for r in responses),
        )

    async def complete_weight_update(
        self, worker_id: str, *, version: int = 0, timeout: float | None = None
    ) -> tuple[Worker, bool]:
        """Puts a worker back with its new version (0: the update's target); returns the
        worker and whether the whole update is over."""
        request = wpb.CompleteWeightUpdateRequest(worker_id=worker_id, version=version)
        responses = await self._broadcast(
            lambda s: s.workers.CompleteWeightUpdate, request, timeout
        )
        finished = all(r.update_finished for r in responses)
        return _convert.worker_from_proto(responses[0].worker), finished

    @contextlib.asynccontextmanager
    async def weight_update(
        self,
        version: int,
        *,
        worker_ids: Sequence[str] = (),
        interrupt_sessions: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[WeightUpdate]:
        """``async with client.weight_update(8) as update:`` load the weights in the body.

        On entry the selected workers leave placement; on a normal exit every one of them
        still updating is completed at ``version``. When the body raises, the workers stay
        out of placement (they may not serve the new weights; saying they do would stamp
        sessions with a lie): complete them, or let their heartbeats report the version."""
        update = await self.begin_weight_update(
            version, worker_ids=worker_ids, interrupt_sessions=interrupt_sessions, timeout=timeout
        )
        yield update
        for worker in update.workers:
            current = await self.get_worker(worker.worker_id, timeout=timeout)
            if current.updating_to_version == version:
                await self.complete_weight_update(
                    worker.worker_id, version=version, timeout=timeout
                )

    # SessionService -----------------------------------------------------------------------

    async def start_session(
        self,
        task_id: str,
        *,
        group_id: str | None = None,
        group_size: int = 0,
        request_id: str | None = None,
        metadata: Mapping[str, str] | None = None,
        options: GroupOptions | None = None,
        placement: PlacementMode | None = None,
        wait_for_admission: bool = False,
        timeout: float | None = None,
    ) -> StartSessionResult:
        """Starts one session and places it on a worker.

        Without ``group_id`` a new group is made; with one, the session joins that group (or
        creates it if unknown). ``group_size`` 0 means 1 for a new group and "the group's size"
        when joining. ``request_id`` (a uuid4 when omitted) is kept across retries, so a retry
        never takes a second slot. ``metadata`` is kept with the session (not sent as gRPC
        headers); ``options`` apply when this call creates the group. With
        ``wait_for_admission`` a start beyond the staleness limit, or during a fleet-wide
        weight update, waits (within ``timeout``) instead of failing at once.
        """
        request = _convert.start_request_to_proto(
            spb.StartSessionRequest,
            task_id=task_id,
            group_id=group_id,
            group_size=group_size,
            request_id=request_id or str(uuid.uuid4()),
            metadata=metadata,
            options=options,
            placement=placement,
            wait_for_admission=wait_for_admission,
        )
        response = await self._unary(
            lambda s: s.sessions.StartSession, request, timeout, self._start_route(group_id)
        )
        return _convert.start_session_result_from_proto(response)

    async def start_group(
        self,
        task_id: str,
        group_size: int,
        *,
        group_id: str | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, str] | None = None,
        options: GroupOptions | None = None,
        placement: PlacementMode | None = None,
        wait_for_admission: bool = False,
        timeout: float | None = None,
    ) -> StartGroupResult:
        """Starts ``group_size`` sessions for ``task_id`` in one round trip: all or none.

        ``result.sessions`` lists the members in index order, each with its worker.
        ``request_id`` works as in ``start_session``.
        """
        request = _convert.start_request_to_proto(
            spb.StartGroupRequest,
            task_id=task_id,
            group_id=group_id,
            group_size=group_size,
            request_id=request_id or str(uuid.uuid4()),
            metadata=metadata,
            options=options,
            placement=placement,
            wait_for_admission=wait_for_admission,
        )
        response = await self._unary(
            lambda s: s.sessions.StartGroup, request, timeout, self._start_route(group_id)
        )
        return _convert.start_group_result_from_proto(response)

    async def abort_session(
        self,
        session: str,
        *,
        reason: str = "",
        timeout: float | None = None,
        retryable: bool = False,
    ) -> Session:
        """Ends a session early: frees its slot; it leaves its group's statistics.

        ``retryable`` says the failure is worth another try: in a group with
        ``GroupOptions.replace_lost`` the router then starts a replacement member and
        announces it on the reward streams (``reward_stream(on_replacement=...)``).
        """
        request = spb.AbortSessionRequest(
            session=session, reason=reason[:1024], retryable=retryable
        )
        response = await self._unary(
            lambda s: s.sessions.AbortSession, request, timeout, self._routing.for_session(session)
        )
        return _convert.session_from_proto(response.session)

    async def get_session(self, session: str, *, timeout: float | None = None) -> Session:
        request = spb.GetSessionRequest(session=session)
        response = await self._unary(
            lambda s: s.sessions.GetSession, request, timeout, self._routing.for_session(session)
        )
        return _convert.session_from_proto(response.session)

    async def get_group(self, group_id: str, *, timeout: float | None = None) -> Group:
        request = spb.GetGroupRequest(group_id=group_id)
        response = await self._unary(
            lambda s: s.sessions.GetGroup, request, timeout, self._routing.for_group(group_id)
        )
        return _convert.group_from_proto(response.group)

    async def list_groups(
        self,
        *,
        state: GroupState | None = None,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Page[Group]:
        """One page of groups in creation order, without members (``get_group`` has them).

        Sharded: the groups of shard 0, then of shard 1, and so on (each shard lists its own);
        the page token says which shard comes next, and a page may be short where one shard's
        list ends.
        """
        shard, inner = 0, page_token
        if self._routing.sharded:
            shard, inner = _split_page_token(page_token, self._routing.count)
        request = spb.ListGroupsRequest(
            page_size=page_size,
            page_token=inner,
            state=_convert.group_state_to_proto(state),
        )
        response = await self._unary(
            lambda s: s.sessions.ListGroups, request, timeout, self._routing.shard(shard)
        )
        next_token = response.next_page_token
        if self._routing.sharded:
            next_token = _join_page_token(shard, next_token, self._routing.count)
        return Page(
            items=tuple(_convert.group_from_proto(g) for g in response.groups),
            next_page_token=next_token,
        )

    async def iter_groups(
        self,
        *,
        state: GroupState | None = None,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> AsyncIterator[Group]:
        """Every group (optionally in one state), fetching pages as needed."""
        token = ""
        while True:
            page = await self.list_groups(
                state=state, page_size=page_size, page_token=token, timeout=timeout
            )
            for group in page.items:
                yield group
            if not page.next_page_token:
                return
            token = page.next_page_token

    def reward_stream(
        self,
        *,
        max_batch: int = 256,
        max_delay: float = 0.005,
        keep_results: bool = True,
        close_timeout: float | None = 10.0,
        timeout: float | None = None,
        reconnect: bool = True,
        on_replacement: ReplacementHook | None = None,
        columnar_results: bool = False,
    ) -> RewardStream:
        """A long-lived SubmitRewards stream for concurrent submitters; see ``RewardStream``.

        For a sharded router, a ``ShardedRewardStream`` with the same methods: one stream per
        shard, opened on the first entry for it, answers in the caller's order.

        ``timeout`` (seconds) is a deadline for the whole stream, reconnects included;
        ``None`` for none. With ``reconnect`` (the default) a stream lost to a restart, a drain
        or a proxy is reopened under the client's retry policy and the unacknowledged entries
        are resent (safe: a recorded reward comes back DUPLICATE). ``on_replacement`` is
        called with each ``Replacement`` the router announces (``replace_lost`` groups).
        ``columnar_results`` asks for group results as arrays (``result_batches()``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def open_stream(route: Route) -> RewardStream:
            metadata = (*self._metadata, *route.headers)

            def open_call() -> grpc.aio.StreamStreamCall[
                spb.SubmitRewardsRequest, spb.SubmitRewardsResponse
            ]:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                return route.stubs.sessions.SubmitRewards(timeout=remaining, metadata=metadata)

            return RewardStream(
                open_call,
                max_batch=max_batch,
                max_delay=max_delay,
                keep_results=keep_results,
                close_timeout=close_timeout,
                retrier=self._retrier if reconnect else None,
                on_replacement=on_replacement,
                columnar_results=columnar_results,
            )

        if not self._routing.sharded:
            return open_stream(self._routing.shard(0))
        if columnar_results:
            raise ValueError(
                "columnar_results is not available on a sharded client: open one client per"
                " shard for the columnar form"
            )

        def open_shard(shard: int, group_id: str | None) -> RewardStream:
            route = self._routing.shard(shard)
            if group_id is not None and self._routing.shard_of(group_id) == shard:
                route = self._routing.for_group(group_id)
            return open_stream(route)

        return ShardedRewardStream(self._routing, open_shard, keep_results=keep_results)

    async def submit_rewards(
        self,
        rewards: Mapping[str, float] | Iterable[tuple[str, float]],
        *,
        timeout: float | None = None,
        filter_metrics: Mapping[str, float] | None = None,
    ) -> SubmitRewardsResult:
        """Submits rewards over a short-lived stream and returns their results.

        ``rewards`` maps session names to rewards. The results are aligned with the entries;
        ``group_results`` holds the groups these rewards finalized. Retried on UNAVAILABLE,
        which is safe (a reward recorded by a lost attempt comes back DUPLICATE), but a group
        finalized by a lost attempt is then only on the feed. For many concurrent rollouts
        prefer one ``reward_stream``. ``filter_metrics`` maps session names to their filter
        metric (see ``RewardStream.submit``); sessions not in it are sent without one.
        """
        metrics = filter_metrics or {}
        entries = [
            (session, reward, metrics.get(session))
            for session, reward in (rewards.items() if isinstance(rewards, Mapping) else rewards)
        ]
        if not self._routing.sharded:
            return await self._submit_on(self._routing.shard(0), entries, timeout)
        # One short stream per shard, concurrently; results back in the caller's order.
        by_shard = list(split_by_shard(self._routing, (e[0] for e in entries)).items())
        routes = [
            self._routing.for_group(group) if group is not None else self._routing.shard(shard)
            for shard, (_, group) in by_shard
        ]
        parts = await asyncio.gather(
            *(
                self._submit_on(route, [entries[p] for p in positions], timeout)
                for route, (_, (positions, _)) in zip(routes, by_shard, strict=True)
            )
        )
        results: list[RewardResult | None] = [None] * len(entries)
        resend: dict[int, list[int]] = {}
        for (shard, (positions, _)), part in zip(by_shard, parts, strict=True):
            for position, result in zip(positions, part.results, strict=True):
                results[position] = result
                owner = wrong_shard_owner(self._routing, result, shard)
                if owner is not None:
                    resend.setdefault(owner, []).append(position)
        group_results = [g for part in parts for g in part.group_results]
        for owner, positions in resend.items():  # once: what the owner says is the answer
            again = await self._submit_on(
                self._routing.shard(owner), [entries[p] for p in positions], timeout
            )
            for position, result in zip(positions, again.results, strict=True):
                results[position] = result
            group_results += again.group_results
        return SubmitRewardsResult(
            results=tuple(r for r in results if r is not None),
            group_results=tuple(group_results),
        )

    async def _submit_on(
        self,
        route: Route,
        entries: list[tuple[str, float, float | None]],
        timeout: float | None,
    ) -> SubmitRewardsResult:
        """``entries`` over one short-lived stream on ``route``, retried while transient."""
        metadata = (*self._metadata, *route.headers)

        async def attempt(remaining: float | None) -> SubmitRewardsResult:
            def open_call() -> grpc.aio.StreamStreamCall[
                spb.SubmitRewardsRequest, spb.SubmitRewardsResponse
            ]:
                return route.stubs.sessions.SubmitRewards(timeout=remaining, metadata=metadata)

            stream = RewardStream(open_call, max_batch=4096, max_delay=0.0, retrier=None)
            async with stream:
                results = await stream.submit_many(entries)
            return SubmitRewardsResult(
                results=tuple(results),
                group_results=tuple([r async for r in stream.results()]),
            )

        budget = self._default_timeout if timeout is None else timeout
        return await self._retrier.call(attempt, timeout=budget)

    def subscribe_groups(
        self,
        *,
        after_cursor: int = 0,
        from_latest: bool = False,
        min_version: int = 0,
        retry_policy: RetryPolicy | None = None,
        max_failed_connections: int | None = None,
        on_retry: FeedRetryHook | None = None,
        skip_degenerate: bool = False,
        on_skipped: FeedSkipHook | None = None,
    ) -> AsyncGenerator[GroupResult, None]:
        """Every finalized or dropped group after ``after_cursor``, then new ones as they come.

        ``after_cursor=0`` starts at the oldest group the router retains; pass the cursor of
        the last group you processed to resume after a restart of the trainer, or
        ``from_latest=True`` to skip the backlog. The iterator reconnects by itself whenever
        the stream is lost (router restart or drain, a proxy's reset), with the backoff of
        ``retry_policy`` (the client's by default), resuming after the last group it yielded:
        nothing is missed, nothing delivered twice (see ``_feed``). It never gives up unless
        ``max_failed_connections`` consecutive connections fail; every retry is logged and
        passed to ``on_retry(failures, error, delay, cursor)``. It never ends by itself; break
        out of the loop (or ``aclose()`` it, or cancel the task) to stop.

        ``skip_degenerate=True`` asks the router to leave out degenerate groups (all rewards,
        or all filter metrics, equal: nothing to learn from); ``min_version`` leaves out
        groups whose ``min_version`` is older. ``on_skipped(count, last_cursor)`` hears how
        many either left out, up to which cursor; a reconnect resumes after the last cursor
        the router covered.
        """
        retrier = self._retrier if retry_policy is None else Retrier(retry_policy)
        # Every shard serves the one merged feed: a lost stream reconnects to the next shard,
        # with the same cursor, so a shard that is down only costs one reconnect.
        first = self._routing.any().shard
        connections = itertools.count(max(first, 0))

        def open_call(
            request: spb.SubscribeGroupsRequest,
        ) -> grpc.aio.UnaryStreamCall[spb.SubscribeGroupsRequest, spb.SubscribeGroupsResponse]:
            route = self._routing.shard(next(connections) % self._routing.count)
            metadata = (*self._metadata, *route.headers)
            return route.stubs.sessions.SubscribeGroups(request, metadata=metadata)

        return follow_feed(
            open_call,
            groups_of,
            after_cursor=after_cursor,
            from_latest=from_latest,
            retrier=retrier,
            max_failed_connections=max_failed_connections,
            on_retry=on_retry,
            skip_degenerate=skip_degenerate,
            on_skipped=on_skipped,
            min_version=min_version,
        )

    # Trainer state ------------------------------------------------------------------------

    async def set_trainer_state(
        self,
        version: int,
        *,
        policy: StalenessPolicy | None = None,
        clear_policy: bool = False,
        reset_counters: bool = False,
        refuse_mixed_versions: bool | None = None,
        timeout: float | None = None,
    ) -> TrainerState:
        """Tells the router the trainer's version (and a staleness policy, when given):
        admission opens as soon as the limit grows. Never lower than the version held."""
        request = spb.SetTrainerStateRequest(
            version=version, clear_policy=clear_policy, reset_counters=reset_counters
        )
        if policy is not None:
            request.policy.max_staleness = policy.max_staleness
            request.policy.batch_size = policy.batch_size
        if refuse_mixed_versions is not None:
            request.refuse_mixed_versions = refuse_mixed_versions
        # Each shard admits its own groups, so each needs the trainer's state.
        (response, *_) = await self._broadcast(
            lambda s: s.sessions.SetTrainerState, request, timeout
        )
        return _convert.trainer_state_from_proto(response.state)

    async def set_trainer_version(
        self, version: int, *, timeout: float | None = None
    ) -> TrainerState:
        """``set_trainer_state(version)``: the call a trainer makes after every step."""
        return await self.set_trainer_state(version, timeout=timeout)

    async def get_trainer_state(self, *, timeout: float | None = None) -> TrainerState:
        """The trainer state, admission counters and any weight update in progress."""
        response = await self._unary(
            lambda s: s.sessions.GetTrainerState, spb.GetTrainerStateRequest(), timeout
        )
        return _convert.trainer_state_from_proto(response.state)

    def subscribe_result_batches(
        self,
        *,
        after_cursor: int = 0,
        from_latest: bool = False,
        retry_policy: RetryPolicy | None = None,
        max_failed_connections: int | None = None,
        on_retry: FeedRetryHook | None = None,
        skip_degenerate: bool = False,
        on_skipped: FeedSkipHook | None = None,
        min_version: int = 0,
    ) -> AsyncGenerator[ResultBatch, None]:
        """``subscribe_groups`` in columnar form: the router sends each message's groups as
        flat arrays, and this yields them as a ``ResultBatch`` (NumPy arrays, no Python
        object per group; ``batch.groups`` builds the typed view when asked). Resume after
        ``batch.last_cursor``. Same reconnection, cursor and skipping rules."""
        retrier = self._retrier if retry_policy is None else Retrier(retry_policy)
        if self._routing.sharded:
            raise ValueError(
                "subscribe_result_batches is not available on a sharded client (sharded"
                " routers serve the merged feed in message form): use subscribe_groups"
            )
        route = self._routing.shard(0)

        def open_call(
            request: spb.SubscribeGroupsRequest,
        ) -> grpc.aio.UnaryStreamCall[spb.SubscribeGroupsRequest, spb.SubscribeGroupsResponse]:
            metadata = (*self._metadata, *route.headers)
            return route.stubs.sessions.SubscribeGroups(request, metadata=metadata)

        return follow_feed(
            open_call,
            batches_of,
            after_cursor=after_cursor,
            from_latest=from_latest,
            retrier=retrier,
            max_failed_connections=max_failed_connections,
            on_retry=on_retry,
            skip_degenerate=skip_degenerate,
            on_skipped=on_skipped,
            min_version=min_version,
            columnar=True,
        )

    # Group helpers ------------------------------------------------------------------------

    async def wait_group_result(
        self,
        group_id: str,
        *,
        poll_interval: float = 0.01,
        max_poll_interval: float = 1.0,
    ) -> GroupResult:
        """Waits until ``group_id`` is finalized or dropped, and returns its result.

        Polls ``get_group`` (every ``poll_interval`` seconds, doubling up to
        ``max_poll_interval``) until the group has a feed cursor, then reads that one result
        from the feed. An incomplete group ends at its deadline, so this may take that long.

        Sharded: ``Group.cursor`` is the owning shard's own cursor k, and the merged feed
        holds each shard's results in its cursor order, so the group sits at a merged cursor
        of at least k: the feed is read from there until the group comes (also waiting while
        the shard's backlog is still on its way to the merged feed).
        """
        interval = poll_interval
        while True:
            group = await self.get_group(group_id)
            if group.cursor > 0:
                break
            await asyncio.sleep(interval)
            interval = min(interval * 2, max_poll_interval)
        if self._routing.sharded:
            return await self._find_on_merged_feed(group_id, group.cursor, max_poll_interval)
        feed = self.subscribe_groups(after_cursor=group.cursor - 1)
        try:
            result = await anext(feed)
        finally:
            await feed.aclose()
        if result.group_id != group_id:
            raise InternalError(
                f"feed cursor {group.cursor} holds group {result.group_id!r}, not {group_id!r}"
            )
        return result

    async def _find_on_merged_feed(
        self, group_id: str, shard_cursor: int, retry_interval: float
    ) -> GroupResult:
        after = shard_cursor - 1
        while True:
            feed = self.subscribe_groups(after_cursor=after)
            try:
                async for result in feed:
                    if result.group_id == group_id:
                        return result
            except OutOfRangeError as error:
                if error.reason == "CURSOR_EXPIRED":
                    after = 0  # the merged feed no longer starts that early: from its oldest
                    continue
                # Ahead of the merged feed: the shard's results are still on their way.
                await asyncio.sleep(retry_interval)
            finally:
                await feed.aclose()

    async def run_group(
        self,
        task_id: str,
        group_size: int,
        rollout: Rollout,
        *,
        group_id: str | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, str] | None = None,
        options: GroupOptions | None = None,
        placement: PlacementMode | None = None,
        rewards: RewardStream | None = None,
    ) -> GroupResult:
        """Starts a group, runs ``rollout`` on every member concurrently, returns its result.

        Each member's reward is submitted as soon as its rollout returns. A rollout that raises
        gets its session aborted (logged, not re-raised), and so does one whose reward is not
        finite; the group then ends partial or dropped, as its options say. Pass ``rewards``
        to share one open reward stream between many concurrent groups; by default each call
        opens its own. Errors of the router itself (stream lost, start refused) are raised.
        If run_group is cancelled, so are the rollouts; their sessions stay open until the
        group's deadline (abort them yourself to free the slots sooner).
        """
        started = await self.start_group(
            task_id,
            group_size,
            group_id=group_id,
            request_id=request_id,
            metadata=metadata,
            options=options,
            placement=placement,
        )
        if rewards is None:
            async with self.reward_stream(keep_results=False) as stream:
                return await self._run_members(started, rollout, stream)
        return await self._run_members(started, rollout, rewards)

    async def _run_members(
        self,
        started: StartGroupResult,
        rollout: Rollout,
        stream: RewardStream,
    ) -> GroupResult:
        on_stream = stream.watch_group(started.group_id)
        failures: list[SessionRouterError] = []

        async def run_one(session: Session) -> None:
            try:
                reward = float(await rollout(session))
            except Exception as error:
                _log.warning("rollout of %s failed; aborting it", session.name, exc_info=error)
                await self._abort_quietly(session, f"rollout failed: {error!r}")
                return
            try:
                result = await stream.submit(session.name, reward)
            except SessionRouterError as error:
                failures.append(error)
                return
            if result.status is RewardStatus.NOT_FINITE:
                await self._abort_quietly(session, f"reward {reward} is not finite")

        members = [asyncio.create_task(run_one(s)) for s in started.sessions]
        try:
            try:
                await asyncio.gather(*members)
            finally:
                # If one member failed unexpectedly, or run_group was cancelled, stop the rest
                # rather than leave them running detached.
                for member in members:
                    member.cancel()
                await asyncio.gather(*members, return_exceptions=True)
            if failures:
                raise failures[0]
            polled = asyncio.ensure_future(self.wait_group_result(started.group_id))
            try:
                done, _ = await asyncio.wait(
                    {on_stream, polled}, return_when=asyncio.FIRST_COMPLETED
                )
                winner = on_stream if on_stream in done and not on_stream.exception() else polled
                return await winner
            finally:
                polled.cancel()
                await asyncio.gather(polled, return_exceptions=True)
        finally:
            if on_stream.done() and not on_stream.cancelled():
                on_stream.exception()  # seen: the stream's failure was handled above
            on_stream.cancel()

    def _start_route(self, group_id: str | None) -> Route | None:
        """A start naming a group goes to its owner; one without goes to the next shard, and
        its retries stay there: the request-id index that makes them safe is per shard."""
        return None if group_id is None else self._routing.for_group(group_id)

    async def _abort_quietly(self, session: Session, reason: str) -> None:
        """Aborts a member so its group need not wait for its deadline; failures are logged."""
        try:
            await self.abort_session(session.name, reason=reason)
        except SessionRouterError as error:
            _log.warning("could not abort %s: %s", session.name, error)


def _split_page_token(token: str, shard_count: int) -> tuple[int, str]:
    """A sharded ``ListGroups`` page token: ``{shard}:{that shard's token}``; '' is shard 0's
    first page."""
    if not token:
        return 0, ""
    head, sep, inner = token.partition(":")
    if not sep or not head.isdigit() or int(head) >= shard_count:
        raise InvalidArgumentError(f"malformed page token {token[:64]!r} for {shard_count} shards")
    return int(head), inner


def _join_page_token(shard: int, inner: str, shard_count: int) -> str:
    """The token of the page after one of ``shard`` that ended with ``inner``."""
    if inner:
        return f"{shard}:{inner}"
    return f"{shard + 1}:" if shard + 1 < shard_count else ""
