"""Event loop choice for the entry point."""

from __future__ import annotations

import asyncio


def install_uvloop() -> bool:
    """Make uvloop the event loop policy when it is installed; True if it now is.

    Call before the loop is created (before asyncio.run). Without uvloop the default loop is
    kept: uvloop is an optimisation, never a requirement.
    """
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
