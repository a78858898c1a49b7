"""Search scenarios over HTTP (recipes with a grid of attempts, such as ttt-discover): the next step to attempt,
and the archive with its best-so-far curve. Reports on attempts arrive through POST /reef/report (api/reports.py).

Knows the wire shapes; reefd/grow/attempts.py keeps the steps and the archive.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from reefd.api import access
from reefd.api.errors import ApiError, json_response, shown
from reefd.loop import ATTEMPTS

MAX_WAIT_S = 60.0


async def next_step(request: web.Request) -> web.Response:
    """The open step's plan (200), opening one from the archive if none is; 202 with Retry-After while the last
    grid trains. `?wait=S` (at most 60) waits up to S seconds for a plan instead of answering 202 at once."""
    name = access.scenario(request, request.match_info["name"], param="name").name
    raw = request.query.get("wait", "0")
    try:
        wait = float(raw)
    except ValueError:
        raise ApiError(400, f"wait: {shown(raw)} is not a number of seconds", param="wait") from None
    if not 0 <= wait <= MAX_WAIT_S:
        raise ApiError(400, f"wait: {raw} is not between 0 and {MAX_WAIT_S:g} seconds", param="wait")
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        status, body = await request.app[ATTEMPTS].plan(name)
        left = deadline - asyncio.get_running_loop().time()
        if status == 200 or left <= 0:
            break
        await asyncio.sleep(min(0.5, left))
    headers = {"Retry-After": str(body.get("retry_after_s", 2))} if status == 202 else None
    return json_response(body, status=status, headers=headers)


async def archive(request: web.Request) -> web.Response:
    name = access.scenario(request, request.match_info["name"], param="name").name
    raw = request.query.get("top", "5")
    try:
        top = int(raw)
    except ValueError:
        top = 0
    if not 1 <= top <= 1000:
        raise ApiError(400, f"top: {shown(raw)} is not an integer from 1 to 1000", param="top")
    return json_response(await request.app[ATTEMPTS].describe(name, top))
