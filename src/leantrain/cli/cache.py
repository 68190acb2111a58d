"""`leantrain cache serve`: the semantic cache as an OpenAI-compatible HTTP server."""

from __future__ import annotations

import ipaddress
import os

import typer

from leantrain.cli.common import (
    ConfigOpt,
    DeviceOpt,
    OverrideOpt,
    command_settings,
    console,
    quiet_libraries,
    user_errors_exit_2,
)
from leantrain.errors import LeantrainError
from leantrain.serving.config import CacheServeConfig


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Semantic cache: serve it over HTTP.", no_args_is_help=True)
    group.command()(serve)
    app.add_typer(group, name="cache")


@user_errors_exit_2
def serve(config: ConfigOpt = None, override: OverrideOpt = None, device: DeviceOpt = None) -> None:
    """Serve /v1/chat/completions from the cache (misses go to the backend), /v1/feedback and
    /metrics; every setting is a field of CacheServeConfig (e.g. -o db=cache.sqlite -o port=8765).
    The bearer token, if any, comes from $LEANTRAIN_CACHE_TOKEN (never the command line, where
    other users can read it); a backend API key from $LEANTRAIN_BACKEND_API_KEY."""
    cfg = command_settings(CacheServeConfig, config, override, device=device)
    token = os.environ.get("LEANTRAIN_CACHE_TOKEN") or None
    if not _is_loopback(cfg.host) and token is None:
        raise LeantrainError(
            f"host {cfg.host} is reachable from other machines: set LEANTRAIN_CACHE_TOKEN"
        )
    import uvicorn

    from leantrain.serving import backends
    from leantrain.serving.cache import SemanticCache
    from leantrain.serving.embedding import make_embedder
    from leantrain.serving.policy import make_policy
    from leantrain.serving.server import create_app

    quiet_libraries()
    if cfg.backend.startswith(("http://", "https://")):
        api_key = os.environ.get("LEANTRAIN_BACKEND_API_KEY")
        chat_backend = backends.OpenAIBackend(cfg.backend, cfg.backend_model, api_key)
    else:
        chat_backend = backends.EngineBackend(cfg.backend, cfg.device)
    embed = make_embedder(cfg.embedder)
    embed(["warm-up"])  # load the embedding model now, not on the first request
    cache = SemanticCache(
        cfg.db,
        embed,
        make_policy(cfg.policy, threshold=cfg.threshold, delta=cfg.delta),
        max_entries=cfg.max_entries,
        eviction=cfg.eviction,
    )
    console.print(
        f"cache [bold]{cfg.db}[/] ({len(cache)} entries), policy [bold]{cfg.policy}[/], "
        f"backend [bold]{cfg.backend}[/], http://{cfg.host}:{cfg.port}/v1"
        + (" (bearer token required)" if token else "")
    )
    app = create_app(cache, chat_backend, token=token, max_body_bytes=cfg.max_body_bytes)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    finally:
        cache.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
