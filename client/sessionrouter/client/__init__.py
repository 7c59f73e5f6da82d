"""Typed asyncio client for sessionrouter."""
