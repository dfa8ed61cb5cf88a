"""How ``kvstore serve`` faces its users: ``FrontConfig``, the command's flags
(``configure``), and the FrontConfig those flags make (``front_config``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from engine_adapter.serving.admission import DEFAULT_TIMEOUT_S, AdmissionConfig
from engine_adapter.serving.api_keys import ApiKeys, admin_key
from engine_adapter.serving.balancer import (
    DEFAULT_BUCKET_BOUNDS_TOKENS,
    POLICIES,
    BalancerConfig,
)
from engine_adapter.serving.http_limits import FrontLimits
from engine_adapter.serving.worker_flags import add_worker_tuning_arguments
from engine_adapter.serving.worker_pool import STARTUP_TIMEOUT_S
from kvstore.cli.args import duration_arg, list_arg, size_arg

DEFAULT_HTTP_PORT = 8000  # vLLM's and SGLang's habit
DEFAULT_MAX_WAITING_REQUESTS = 64
DEFAULT_MAX_QUEUE_WAIT_S = 30.0
DEFAULT_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class FrontConfig:
    """How ``kvstore serve`` faces its users."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT  # the OpenAI-compatible HTTP front; 0: any free port
    grpc_port: int | None = None  # the router's gRPC face (ServingClient); None: off
    model: str = "default"
    served_model_name: str = ""  # "" = loader.model_name(model)
    api_keys: Path | None = None
    api_key_values: tuple[str, ...] = ()  # --api-key: keys of tenant "default"
    admin_key_file: Path | None = None
    policy: str = "balanced"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    request_timeout_s: float = DEFAULT_TIMEOUT_S
    limits: FrontLimits = field(default_factory=FrontLimits)
    bucket_bounds_tokens: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS_TOKENS
    log_requests: bool = True
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S  # 0: no stats line

    def __post_init__(self) -> None:
        wait_s = self.admission.max_queue_wait_s
        if not self.request_timeout_s > 0 or wait_s >= self.request_timeout_s:
            raise ValueError(
                f"request timeout {self.request_timeout_s} s: give a positive one, above the "
                f"longest queue wait ({wait_s} s)"
            )

    def keys(self) -> ApiKeys:
        """The API keys and the admin key (a new one is written where none exists)."""
        admin = admin_key(self.admin_key_file) if self.admin_key_file else None
        return ApiKeys.load(self.api_keys, self.api_key_values, admin)


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore serve``."""
    defaults = FrontConfig()
    parser.add_argument("--cluster", required=True, type=Path, help="the store's cluster.toml")
    _add_front_flags(parser, defaults)
    _add_limit_flags(parser, defaults)
    _add_worker_flags(parser, defaults)
    _add_router_flags(parser, defaults)
    _add_log_flags(parser, defaults)
    add_worker_tuning_arguments(parser)


def _add_front_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """Where the HTTP front (and the gRPC face) listen, and whom they serve."""
    parser.add_argument("--host", default=defaults.host, help="HTTP (and gRPC) address to bind")
    parser.add_argument(
        "--port",
        type=int,
        default=defaults.port,
        help="OpenAI-compatible HTTP port, 0: any free one",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the router's gRPC face (ServingClient) here, 0: any (default: off)",
    )
    parser.add_argument(
        "--api-keys",
        type=Path,
        help='TOML file with a [keys] table of "KEY" = "TENANT" (default: none; without it '
        "and --api-key there is no auth and every request is tenant 'default')",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an API key of tenant 'default', as vllm serve's (repeat the flag for more)",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        help="file with the key /admin/* needs (kvstore serve drain); made, mode 0600, if "
        "missing (default: RUN_DIR/admin.key)",
    )
    parser.add_argument(
        "--served-model-name",
        default="",
        help="the model name clients send (default: the model's name, e.g. SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--tls-cert-file",
        type=Path,
        help="with a TLS cluster: the certificate (of its CA, for 127.0.0.1) router and workers "
        "talk over (default: issued from the CA key beside the cluster's CA file, if there)",
    )
    parser.add_argument("--tls-key-file", type=Path, help="the key of --tls-cert-file")


def _add_limit_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """Limits against floods and slow clients."""
    limits = defaults.limits
    parser.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help="open HTTP connections; more are answered 503 and closed",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=size_arg,
        default=limits.max_body_bytes,
        help="largest request body (e.g. 2MiB); larger ones get 413 before they are read",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=duration_arg,
        default=limits.header_timeout_s,
        help="seconds a client has to send a request's headers (else 408, closed)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=duration_arg,
        default=limits.body_timeout_s,
        help="seconds a client has to send the whole body after the headers (else 408, closed)",
    )


def _add_worker_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """How many workers of each role, running which model."""
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=2,
        help="prefill worker processes",
    )
    parser.add_argument(
        "--decode-workers",
        type=int,
        default=1,
        help="decode worker processes",
    )
    parser.add_argument(
        "--model",
        default=defaults.model,
        help="which model: 'default' is SmolLM2-135M-Instruct; also random:<size>, a .gguf "
        "file or a safetensors dir; default: %(default)s",
    )


def _add_router_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """How the router picks prefill workers and queues requests; where the workers log."""
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=defaults.policy,
        help="how prefill workers are picked",
    )
    parser.add_argument(
        "--bucket-bounds",
        type=list_arg(int),
        default=DEFAULT_BUCKET_BOUNDS_TOKENS,
        help="prompt-length bucket bounds in tokens (<16K, 16-64K, 64-256K, >=256K)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=duration_arg,
        default=defaults.request_timeout_s,
        help="a request's deadline, from its arrival to its last token",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=0,
        help="requests sent to the workers at once (0: prefill workers + 2 x decode workers, "
        "what they serve without queueing out of sight)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests queued for a worker; more get 429 at once (0: no limit)",
    )
    parser.add_argument(
        "--max-queue-wait-s",
        type=duration_arg,
        default=DEFAULT_MAX_QUEUE_WAIT_S,
        help="longest wait in the queue: a request that waited this long, or would by the "
        "rate requests finish, gets 429 with Retry-After (0: up to its deadline)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="worker logs and ready files (default: a new temporary directory)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=duration_arg,
        default=STARTUP_TIMEOUT_S,
        help="how long the workers may take to load the model and calibrate",
    )


def _add_log_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """The request log and the stats line (vllm serve's flags)."""
    parser.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per request"
    )
    parser.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    parser.add_argument(
        "--stats-interval-s",
        type=duration_arg,
        default=defaults.stats_interval_s,
        help="seconds between two stats lines (logged only while something happens)",
    )


def front_config(args: argparse.Namespace, run_dir: Path) -> FrontConfig:
    """The FrontConfig of parsed ``kvstore serve`` flags; ValueError/KVStoreError if bad."""
    max_running = args.max_running_requests or args.prefill_workers + 2 * args.decode_workers
    front = FrontConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        model=args.model,
        served_model_name=args.served_model_name,
        api_keys=args.api_keys,
        api_key_values=tuple(args.api_key),
        admin_key_file=args.admin_key_file or run_dir / "admin.key",
        policy=args.policy,
        admission=AdmissionConfig(max_running, args.max_waiting_requests, args.max_queue_wait_s),
        request_timeout_s=args.request_timeout_s,
        limits=FrontLimits(
            max_connections=args.max_connections,
            header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s,
            max_body_bytes=args.max_body_bytes,
        ),
        bucket_bounds_tokens=BalancerConfig(
            bucket_bounds_tokens=tuple(args.bucket_bounds)
        ).bucket_bounds_tokens,
        log_requests=not args.disable_log_requests,
        stats_interval_s=0.0 if args.disable_log_stats else args.stats_interval_s,
    )
    front.keys()  # a bad key file fails before the workers start
    return front
