"""Typed application keys: the resources that handlers read from the app."""

from __future__ import annotations

from aiohttp import web

from reefd.records import RecordStore
from reefd.releases import ReleaseChain
from reefd.scenarios import Registry
from reefd.schedule import Scheduler

REGISTRY = web.AppKey("registry", Registry)
STORE = web.AppKey("store", RecordStore)
STARTED_AT = web.AppKey("started_at", float)
CHAIN = web.AppKey("chain", ReleaseChain)
SCHEDULER = web.AppKey("scheduler", Scheduler)
