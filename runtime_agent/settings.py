"""The agent's settings: frozen data built once by the CLI, passed to everything that needs it.

Nothing below the CLI reads the environment or flags; tests build Settings directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

from msgspec import Struct, field

from contract.phases import DEFAULT_RESTART_DELAYS
from guard.redact import repr_without
from guard.tokens import TokenSource
from runtime_agent.cadence import Cadence

DEFAULT_STATE_DIR = Path("/var/run/aibrix")
SIM_ENGINE_COMMAND: tuple[str, ...] = (sys.executable, "-m", "engines.sim", "serve")
VLLM_ENGINE_COMMAND: tuple[str, ...] = ("vllm", "serve")
SGLANG_ENGINE_COMMAND: tuple[str, ...] = ("python3", "-m", "sglang.launch_server")
_SECRETS = frozenset({"hf_token", "api_token"})


class Settings(Struct, frozen=True):
    host: str = "0.0.0.0"
    port: int = 8080
    # The kubelet's probes on a port and process of their own (runtime_agent.api.probes); None:
    # only the API's own /healthz and /ready. A loop silent this long answers 503 there.
    health_probe_port: int | None = None
    probe_stall_s: float = 10.0
    state_dir: Path = DEFAULT_STATE_DIR
    # Engines listen on a port in this range for their whole life.
    port_low: int = 20000
    port_high: int = 20999
    # The address engines bind (reachable by the gateway) and the one the agent probes them on.
    engine_bind_host: str = "0.0.0.0"
    engine_probe_host: str = "127.0.0.1"
    # Restart policy: delays before restarts 1..N; the engine fails after len(delays) restarts.
    restart_delays: tuple[float, ...] = DEFAULT_RESTART_DELAYS
    # Readiness probes: first delay after start, growth factor, cap.
    probe_first_s: float = 0.005
    probe_factor: float = 1.5
    probe_max_s: float = 0.05
    probe_timeout_s: float = 2.0
    # Stop: SIGTERM to the process group, this long, then SIGKILL.
    stop_grace_s: float = 10.0
    engine_cgroups: bool = True  # one cgroup v2 per engine where one can be created
    # Sleep and wake calls can take long on big models; the owner waits this long at most.
    lifecycle_timeout_s: float = 300.0
    # How often an awake engine's /metrics is scraped (figures cached for the snapshot).
    scrape_interval_s: float = 2.0
    # Per-engine log files are cut back to about this size (copy-truncate).
    log_max_bytes: int = 16 * 1024 * 1024
    log_check_interval_s: float = 5.0
    # Engine commands: the argv prefix for each engine kind, before "MODEL --flags".
    vllm_command: tuple[str, ...] = VLLM_ENGINE_COMMAND
    ollama_command: tuple[str, ...] = ("ollama", "serve")
    sglang_command: tuple[str, ...] = SGLANG_ENGINE_COMMAND
    # Real vLLM can sleep only on GPU platforms; on CPU it refuses --enable-sleep-mode.
    vllm_sleep_mode: bool = True
    # GPU memory: "auto" (NVML if it finds a GPU, else simulated), "nvml" or "sim".
    gpu_backend: str = "auto"
    simulate_gpus: str = "1x80GiB"
    # Set by the agent when the GPU is simulated: where simulated engines report their memory.
    sim_gpu_dir: Path | None = None
    # Per card, kept out of every budget: CUDA context, fragmentation, the driver.
    gpu_reserve_bytes: int = 1 << 30
    host_reserve_bytes: int = 2 << 30
    gpu_sample_interval_s: float = 1.0
    # A booting engine that neither opens its port nor writes to its log for this long failed.
    start_stall_s: float = 600.0
    sim_command: tuple[str, ...] = SIM_ENGINE_COMMAND
    # Run simulated engines in place of vLLM (the embedded default on a machine without a GPU).
    simulate_engines: bool = False
    # Why a real engine kind cannot run here, as found at start (``python -m`` modules that
    # are not installed): (kind, why) pairs; activations for those kinds answer 503.
    engine_problems: tuple[tuple[str, str], ...] = ()
    # The weight cache (AIBRIX_WEIGHT_CACHE_DIR): artifacts staged before engines need them.
    weight_cache_dir: Path | None = None
    artifact_reserve_bytes: int = 1 << 30  # kept free on the cache's disk
    artifact_local_roots: tuple[Path, ...] = ()  # local paths the cache may copy from
    hf_endpoint: str | None = None  # HF_ENDPOINT
    hf_token: str | None = None  # HF_TOKEN (never in the repr)
    s3_endpoint_url: str | None = None  # an S3-compatible store (AWS_ENDPOINT_URL_S3)
    # kvcached segments: their directory, how often to look for a new one, how often to check it.
    kv_shm_dir: Path = Path("/dev/shm")
    kv_watch_s: float = 0.01
    kv_hold_s: float = 1.0
    extra_engine_env: dict[str, str] = field(default_factory=dict)
    # /ready waits this long at most for re-adopted engines to show their first state.
    settle_timeout_s: float = 60.0
    # Access: a bearer token for every call that changes something (and reads, if asked).
    api_token: TokenSource | None = None  # guard.tokens (never in the repr)
    auth_reads: bool = False
    # --trust-remote-code runs a model repository's code on this node: off unless allowed.
    allow_trust_remote_code: bool = False
    # Alive is not enough: an awake engine is probed this often; after this many misses in a row
    # it is not ready (EngineUnresponsive), and after this long unresponsive it is restarted.
    health_interval_s: float = 1.0
    unresponsive_after: int = 3
    unresponsive_grace_s: float = 30.0
    # While nothing changes, a steady engine's health probes, scrapes and KV checks slow down,
    # doubling up to this many times their interval (1: a fixed interval); any change brings
    # them back to it (runtime_agent.cadence).
    steady_backoff: float = 10.0
    # ... and scrapes at most to this (the first request after a quiet spell is in the
    # snapshot's figures within it). An idle sleep's last look does not rest on them: it reads
    # the engine then (``?fresh=requests``, ``runtime_agent.api.fresh``), so they may back off
    # as far as the probes do.
    scrape_interval_max_s: float = 20.0
    # The restart budget starts again after an engine served this long without a crash.
    budget_reset_s: float = 600.0

    def __repr__(self) -> str:
        return repr_without(self, _SECRETS)

    @property
    def health_cadence(self) -> Cadence:
        return Cadence(self.health_interval_s, self.health_interval_s * self.steady_backoff)

    @property
    def scrape_cadence(self) -> Cadence:
        s = self.scrape_interval_s
        return Cadence(s, min(s * self.steady_backoff, max(s, self.scrape_interval_max_s)))

    @property
    def kv_hold_cadence(self) -> Cadence:
        return Cadence(self.kv_hold_s, self.kv_hold_s * self.steady_backoff)

    @property
    def engines_dir(self) -> Path:
        return self.state_dir / "engines"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"
