"""Every Prometheus metric nesa-node exports, named in one place (prometheus-client, imported only when a process
serves /metrics: the `gateway` extra).

Names: `nesa_node_` for a node, `nesa_gateway_` for the gateway, snake_case with the unit last (`_seconds`,
`_bytes`, `_ratio`, `_total` for counters), no colons. Histograms use fixed buckets, documented here:
- STEP_BUCKETS (seconds): one step of a span, 0.5 ms (a decode step of a few blocks on a GPU) to 10 s (a long
  prefill on a CPU);
- LATENCY_BUCKETS (seconds): what a user waits for, 5 ms to 60 s.
Each node, gateway or client gets a registry of its own (several live in one process in tests), served by
`serve_registry` (a node's, with its /health beside) or the gateway's `/metrics` route.
"""

from __future__ import annotations

from collections.abc import Callable

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class NodeMetrics:
    """A node's metrics. The gauges read the node's state when scraped (`bind`); the rest is counted as it happens."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.sessions = Gauge("nesa_node_sessions", "Inference sessions open on this node", registry=registry)
        self.kv_cache_bytes = Gauge(
            "nesa_node_kv_cache_bytes", "KV cache bytes of the node's budget, by state", ["state"], registry=registry
        )
        self.kv_cache_usage_ratio = Gauge(
            "nesa_node_kv_cache_usage_ratio", "Share of the KV cache budget reserved by sessions", registry=registry
        )
        self.queued_steps = Gauge("nesa_node_queued_steps", "Steps waiting for compute", registry=registry)
        self.dht_peers = Gauge("nesa_node_dht_peers", "Peers in this node's DHT routing table", registry=registry)
        self.step_duration_seconds = Histogram(
            "nesa_node_step_duration_seconds",
            "Compute time of one step of a session in this node's blocks, by phase (prefill: more than one token)",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.push_duration_seconds = Histogram(
            "nesa_node_push_duration_seconds",
            "Time to hand a step's output to the next node",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.wire_bytes_total = Counter(
            "nesa_node_wire_bytes_total",
            "Hidden-state bytes of steps, by direction (in: received, out: sent on) and codec",
            ["direction", "codec"],
            registry=registry,
        )
        self.rpcs_total = Counter(
            "nesa_node_rpcs_total", "RPCs answered, by kind and status", ["rpc", "status"], registry=registry
        )
        self.replayed_steps_total = Counter(
            "nesa_node_replayed_steps_total",
            "Steps replayed into this node to rebuild a session's cache after a failover",
            registry=registry,
        )
        self.preempted_sessions_total = Counter(
            "nesa_node_preempted_sessions_total", "Idle sessions ended to admit new ones", registry=registry
        )
        self.opening_streams_refused_total = Counter(
            "nesa_node_opening_streams_refused_total",
            "Streams ended before they said what they were for: over their peer's share, or evicted past the total",
            ["reason"],
            registry=registry,
        )
        for reason in ("peer_share", "evicted"):
            self.opening_streams_refused_total.labels(reason)
        self.adapters = Gauge(
            "nesa_node_adapters",
            "LoRA adapters on this node, by state (resident: held; pinned: used by an open session)",
            ["state"],
            registry=registry,
        )
        self.adapter_bytes = Gauge(
            "nesa_node_adapter_bytes", "Bytes of the LoRA adapter slices this node holds", registry=registry
        )
        for state in ("used", "free"):  # present from the start, zero until bound
            self.kv_cache_bytes.labels(state)
        for phase in ("prefill", "decode"):
            self.step_duration_seconds.labels(phase)

    def bind(
        self,
        *,
        sessions: Callable[[], int],
        cache_used: Callable[[], int],
        cache_free: Callable[[], int],
        queued: Callable[[], int],
        dht_peers: Callable[[], int],
        adapters=None,
        compute=None,
    ) -> None:
        """Make the gauges read the node's state when scraped (`adapters`: the node's NodeAdapters; `compute`: its
        BlockCompute, whose counters of decode batching are read then too)."""
        if compute is not None:
            self.registry.register(_ComputeCollector(compute))
        if adapters is not None:
            self.adapters.labels("resident").set_function(lambda: adapters.store.resident)
            self.adapters.labels("pinned").set_function(lambda: adapters.store.pinned)
            self.adapter_bytes.set_function(lambda: adapters.store.used_bytes)
        self.sessions.set_function(sessions)
        self.kv_cache_bytes.labels("used").set_function(cache_used)
        self.kv_cache_bytes.labels("free").set_function(cache_free)

        def usage() -> float:
            total = cache_used() + cache_free()
            return cache_used() / total if total else 0.0

        self.kv_cache_usage_ratio.set_function(usage)
        self.queued_steps.set_function(queued)
        self.dht_peers.set_function(dht_peers)


class _ComputeCollector:
    """A node's compute counters (server/compute.py `BlockCompute`), read when scraped: how its decode steps ran
    (batched passes and how full they were, the gathering's waits, on the event loop or the compute thread)."""

    COUNTERS = (
        ("nesa_node_compute_seconds", "Seconds spent in the node's blocks (steps and passes)", "compute_seconds"),
        ("nesa_node_decode_passes", "Batched passes of more than one session's step", "batches_run"),
        ("nesa_node_decode_pass_steps", "Steps run in batched passes (over the passes: steps a pass)", "steps_in_passes"),
        ("nesa_node_decode_gather_waits", "Waits of the decode queue for other sessions' steps before a pass (each "
         "wake-up counts)", "gather_waits"),
        ("nesa_node_decode_gather_wait_seconds", "Seconds the decode queue waited for other sessions' steps before "
         "its passes", "gather_wait_s"),
        ("nesa_node_decode_lone_steps", "One-token steps of a lone session run at once on the event loop, with no "
         "pass (counted in inline steps too)", "lone_steps"),
        ("nesa_node_split_passes", "Batched passes that failed and ran again a step at a time", "passes_split"),
        ("nesa_node_single_passes", "Steps given alone while other sessions stepped, run as a pass of one (with "
         "--cuda-graphs)", "single_passes"),
        ("nesa_node_fixed_passes", "Passes replayed as a fixed batch (a CUDA graph: --cuda-graphs), passes of one "
         "included",
         "fixed_passes"),
        ("nesa_node_fixed_absent_rows", "Rows fixed batches ran for their sessions that had no step in the pass",
         "fixed_absent_rows"),
        ("nesa_node_fixed_batches_built", "Fixed batches built (a CUDA graph captured each)", "fixed_built"),
        ("nesa_node_step_graphs_built", "Sessions' one-token steps captured as CUDA graphs (--cuda-graphs; the "
         "warm-up's at start and after a move included)", "step_graphs_built"),
        ("nesa_node_inline_steps", "Steps and passes computed on the node's event loop", "inline_steps"),
        ("nesa_node_thread_steps", "Steps, passes and training passes computed on the node's compute thread",
         "thread_steps"),
    )  # fmt: skip

    def __init__(self, compute) -> None:
        self.compute = compute

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, documentation, attribute in self.COUNTERS:
            yield CounterMetricFamily(name, documentation, value=getattr(self.compute, attribute))
        memory = self.compute.device_memory()
        if memory is not None:  # a CUDA node: what its process holds of the device
            family = GaugeMetricFamily(
                "nesa_node_device_memory_bytes",
                "CUDA device memory this node's process holds, by state (allocated: tensors; reserved: torch's caching "
                "allocator, CUDA graphs' pools included; peak: the most reserved since start)",
                labels=["state"],
            )
            for state, value in memory.items():
                family.add_metric([state], value)
            yield family


class GatewayMetrics:
    """The gateway's metrics: requests as a user sees them."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests_total = Counter(
            "nesa_gateway_requests_total",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.requests_running = Gauge(
            "nesa_gateway_requests_running", "Requests generating in the swarm now", registry=registry
        )
        self.requests_waiting = Gauge(
            "nesa_gateway_requests_waiting", "Requests waiting for a free generation slot", registry=registry
        )
        self.time_to_first_token_seconds = Histogram(
            "nesa_gateway_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency_seconds = Histogram(
            "nesa_gateway_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.request_duration_seconds = Histogram(
            "nesa_gateway_request_duration_seconds",
            "From a request's arrival to its last token (end-to-end latency)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens_total = Counter(
            "nesa_gateway_prompt_tokens_total", "Prompt tokens of the requests served", registry=registry
        )
        self.generation_tokens_total = Counter(
            "nesa_gateway_generation_tokens_total", "Tokens generated for the requests served", registry=registry
        )
        self.failovers_total = Counter(
            "nesa_gateway_failovers_total",
            "Nodes replaced in the middle of a request's session (the failed node banned, its blocks re-routed)",
            registry=registry,
        )
        self.failover_recovery_seconds = Histogram(
            "nesa_gateway_failover_recovery_seconds",
            "From a node's failure to its replacement holding the session's cache again",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.dht_peers = Gauge("nesa_gateway_dht_peers", "Peers in the gateway's DHT routing table", registry=registry)
        self.adapter_requests = Gauge(
            "nesa_gateway_adapter_requests",
            'Requests running or waiting for a slot, by LoRA adapter: its name when loaded into the gateway, "swarm" for '
            'one the nodes announce, "base" for none',
            ["adapter", "state"],
            registry=registry,
        )
        self.adapters_loaded = Gauge(
            "nesa_gateway_adapters_loaded", "LoRA adapters loaded into the gateway (POST /v1/adapters/load)",
            registry=registry,
        )  # fmt: skip
        self.verification_checks_total = Counter(
            "nesa_gateway_verification_checks_total",
            'Output checks, by result: of voted spans (--verify majority:N) "agreed", "outvoted" (a replica outvoted '
            'and banned) or "no_consensus" (the request failed); of audited windows (--verify audit:P) "passed", '
            '"failed", "inconclusive" (the auditors disagreed) or "unrecorded" (a hop sent no record); of nodes sent '
            'canaries (--verify canary:P) "passed", "failed" (blamed: two failed), "inconclusive" (one of two '
            'failed), "skipped" (quantized, or no record; or a streamed answer while the checks waiting are many) '
            'or "unanswered"',
            ["result"],
            registry=registry,
        )
        for state in ("running", "waiting"):
            self.adapter_requests.labels("base", state)
        for result in (
            "agreed", "outvoted", "no_consensus", "passed", "failed", "inconclusive", "unrecorded", "skipped",
            "unanswered",
        ):  # fmt: skip
            self.verification_checks_total.labels(result)


def exposition(registry) -> tuple[bytes, str]:
    """The registry in Prometheus's text format, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


def serve_registry(registry, host: str, port: int, *, health: Callable[[], tuple[bool, dict]] | None = None):
    """Serve `registry` at http://host:port/metrics on a thread of its own; returns (server, thread, port).

    With `health`, GET /health answers what it returns, `(healthy, body)`: the body as JSON, status 200 when healthy
    and 503 otherwise (a container's HEALTHCHECK or a load balancer reads the status). It is called on the server's
    thread. Every other path serves the metrics, as prometheus-client's own server does."""
    import json
    import socket
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        if health is None or environ.get("PATH_INFO") != "/health" or environ.get("REQUEST_METHOD") != "GET":
            return metrics_app(environ, start_response)
        healthy, body = health()
        payload = json.dumps(body).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
        start_response("200 OK" if healthy else "503 Service Unavailable", headers)
        return [payload]

    class Server(ThreadingMixIn, WSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True  # a request in flight never holds the process at exit

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format, *args) -> None:  # a scrape every few seconds is not worth a log line
            pass

    server = make_server(host, port, app, server_class=Server, handler_class=QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name=f"metrics-{server.server_port}", daemon=True)
    thread.start()
    return server, thread, server.server_port


__all__ = ["GatewayMetrics", "LATENCY_BUCKETS", "NodeMetrics", "STEP_BUCKETS", "exposition", "serve_registry"]
