"""The floor under reefd's CPU per turn: the least an aiohttp proxy does, in a process of its own.

`plain`: an aiohttp server whose one handler reads the JSON body, forwards it with an aiohttp client session
(one kept-alive connection pool, as reefd's upstream engine) and answers the upstream's JSON.
`durable`: the same, plus one LMDB put committed with fsync per turn before the answer (what a receipt
promises), on a writer thread as reefd's record writer.
bench/proxy_overhead.py runs both beside reefd, so the part of reefd's CPU that is its own can be read off.
Run alone: python bench/bare_proxy.py --port N --upstream URL [--durable DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import lmdb
from aiohttp import web


def app(upstream: str, durable: Path | None) -> web.Application:
    env = lmdb.open(str(durable), map_size=1 << 30) if durable is not None else None
    session: list[aiohttp.ClientSession] = []

    async def startup(_: web.Application) -> None:
        session.append(aiohttp.ClientSession())

    async def cleanup(_: web.Application) -> None:
        await session[0].close()

    def put(key: bytes, value: bytes) -> None:
        assert env is not None
        with env.begin(write=True) as txn:
            txn.put(key, value)

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        async with session[0].post(upstream + "/chat/completions", json=body,
                                   headers={"Authorization": request.headers["Authorization"]}) as r:
            answer = await r.json()
        if env is not None:
            record = json.dumps({"request": body, "response": answer, "at": time.time()}).encode()
            await asyncio.to_thread(put, os.urandom(16), record)
        return web.json_response(answer)

    a = web.Application()
    a.router.add_post("/v1/chat/completions", chat)
    a.on_startup.append(startup)
    a.on_cleanup.append(cleanup)
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the provider's base URL, e.g. http://127.0.0.1:N/v1")
    ap.add_argument("--durable", type=Path, help="an LMDB folder: record every turn there, fsynced")
    args = ap.parse_args()
    web.run_app(app(args.upstream, args.durable), host="127.0.0.1", port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
