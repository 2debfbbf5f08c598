"""The typed keys of what a replica's app holds (`app[UPDATER]`), shared by its handlers."""

from __future__ import annotations

from aiohttp import web

from lookup_table.config import ClusterConfig
from lookup_table.store import EmbeddingStore
from optimizer_service.engine.updater import Updater
from optimizer_service.metrics import ServiceMetrics

__all__ = ["CONFIG", "METRICS", "REPLICA", "STORE", "UPDATER"]

CONFIG = web.AppKey("config", ClusterConfig)
REPLICA = web.AppKey("replica", int)
METRICS = web.AppKey("metrics", ServiceMetrics)
STORE = web.AppKey("store", EmbeddingStore)
UPDATER = web.AppKey("updater", Updater)
