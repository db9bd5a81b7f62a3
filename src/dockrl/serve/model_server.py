"""`dockrl serve MODEL`: the OpenAI-compatible API over a model directory or checkpoint, in this process.

load the model (a checkpoint root: its hf/ export, or its LoRA base with the adapters merged), its tokenizer
─▶ RolloutEngine (max_batch_size slots) ─▶ EngineLoop ─▶ make_app ─▶ uvicorn on host:port
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

# A real model's positions (Qwen2.5: 32768) times 16 slots would allocate tens of GB of KV cache at start.
DEFAULT_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class ServeSettings:
    """What `dockrl serve` was asked for."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_tokens: int = 256
    max_batch_size: int = 16
    max_seq_len: int | None = None
    """Prompt + completion tokens per request; None: the model's positions, at most DEFAULT_MAX_SEQ_LEN. The KV
    cache holds max_batch_size x max_seq_len positions, allocated at start."""
    device: str = "cpu"
    name: str | None = None  # the model name /v1/models lists (default: the directory's name)
    temperature: float | None = None  # every request's, whatever it asks (None: the request's)


def build_app(settings: ServeSettings, sessions: Any = None) -> tuple[FastAPI, Any, str]:
    """The app over `settings.model`, its engine loop (to close) and the API key it checks; `sessions` (a
    server.SessionHooks) sees each session's requests."""
    from dockrl.checkpoint.inference import load_for_inference, vision_inputs
    from dockrl.engines.rollout.rollout_engine import RolloutEngine
    from dockrl.models.tokenizer import stop_token_ids
    from dockrl.serve.engine_loop import EngineLoop
    from dockrl.serve.server import make_app

    model, tokenizer = load_for_inference(settings.model, device=settings.device)
    stops = stop_token_ids(tokenizer.eos_token_id, model.args.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    positions = model.args.max_position_embeddings
    max_seq_len = settings.max_seq_len or min(positions, DEFAULT_MAX_SEQ_LEN)
    if not 2 <= max_seq_len <= positions:
        raise ValueError(f"--max-seq-len={max_seq_len} must be in [2, {positions}] (the model's positions)")
    if settings.max_batch_size < 1 or settings.max_tokens < 1:
        raise ValueError(
            f"--max-batch-size={settings.max_batch_size} and --max-tokens={settings.max_tokens} must be >= 1"
        )
    engine = RolloutEngine(
        model,
        num_slots=settings.max_batch_size,
        max_seq_len=max_seq_len,
        pad_token_id=pad,
        detokenize=tokenizer.decode,
        vision=vision_inputs(
            settings.model, model.args
        ),  # a vision model serves text messages (docs/vision.md)
    )
    loop = EngineLoop(engine, stops)
    key = settings.api_key or secrets.token_urlsafe(24)
    app = make_app(
        loop.generate,
        tokenizer,
        family=model.args.family,
        api_key=key,
        model_name=settings.name or str(settings.model).rstrip("/").rsplit("/", 1)[-1],
        max_tokens=min(settings.max_tokens, max_seq_len - 1),
        max_seq_len=max_seq_len,
        vocab_size=model.args.vocab_size,
        stop_token_ids=stops,
        sessions=sessions,
        temperature=settings.temperature,
    )
    return app, loop, key


class Background:
    """A uvicorn server for `app` on a free loopback port in a daemon thread (`dockrl eval --agent`, tests)."""

    def __init__(self, app: FastAPI):
        import socket
        import threading
        import time

        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, name="dockrl-serve", daemon=True)
        self.thread.start()
        for _ in range(600):  # bounded: a local server is up in well under a second
            if self.server.started:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the local OpenAI-compatible server did not start within 30 s")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(settings: ServeSettings) -> None:
    """Build the app and serve it until interrupted."""
    import uvicorn

    app, loop, key = build_app(settings)
    if settings.api_key is None:
        print(f"dockrl serve: API key {key} (set --api-key or DOCKRL_API_KEY to choose one)", flush=True)
    print(f"dockrl serve: http://{settings.host}:{settings.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        loop.close()
