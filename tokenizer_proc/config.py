"""The tokenizer process's configuration, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.flags import flag, given, mmproj_field, seed_field
from tokenizer_proc.images import ImageLimits


@dataclass(frozen=True)
class TokenizerConfig:
    """``model_path`` is the resolved HF directory holding the tokenizer files.

    ``http_port`` None serves no HTTP API (0 picks a free port, logged at start).
    On SIGTERM, requests in flight get up to ``shutdown_timeout_s`` to finish
    before they are failed; new ones are refused meanwhile.
    """

    model_path: str = given("", "the launcher: --model resolved to an HF directory")
    seed: int = seed_field()
    http_host: str = flag("127.0.0.1", "HTTP bind address (default: loopback only)", name="--host")
    http_port: int | None = flag(
        None, "HTTP API port (default: off; 0: any free port, named in the ready line)"
    )
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on /v1")
    served_model_name: str = flag(
        "rivulet", "model id on /v1 (default: model name)", unset_default=None
    )  # unset: the launcher names it after --model
    shutdown_timeout_s: float = flag(0.0, "SIGTERM drains for up to S s", name="--shutdown-timeout")
    dp_size: int = flag(1, "data-parallel replicas: scheduler + worker pairs, each on its share of the cores")
    dp_routing: str = flag(
        "cache_aware", "how requests pick a replica", choices=("cache_aware", "round_robin", "least_load")
    )
    pooling: str = flag(
        "auto",
        "how embeddings pool the prompt's hidden states: auto (the model's sentence-transformers"
        " Pooling module, else the last token), last or mean (whatever the model's files say)",
        choices=("auto", "last", "mean"),
    )
    allowed_local_media_path: str | None = flag(
        None, "image parts may name local files under this directory (default: none may)"
    )
    max_images_per_request: int = flag(8, "images one request may carry")
    max_image_bytes: int = flag(20 * 2**20, "bytes of one image's file (past it: a 413)")
    mmproj: str | None = mmproj_field()

    def __post_init__(self) -> None:
        assert self.shutdown_timeout_s >= 0, f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}"
        assert self.http_port is None or 0 <= self.http_port < 65536, f"bad http_port {self.http_port}"
        assert self.dp_size >= 1, f"dp_size must be >= 1, got {self.dp_size}"
        assert self.pooling in ("auto", "last", "mean"), f"bad pooling {self.pooling!r}"

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(
            max_images=self.max_images_per_request,
            max_bytes=self.max_image_bytes,
            local_dir=self.allowed_local_media_path,
        )
