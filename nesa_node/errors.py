"""Every error a peer or a user can cause, each with a stable code.

    NesaError (code)
    ├── ModelLoadError              model_load       bad model folder, missing weights, bad block range
    │   ├── UnsupportedModelError   unsupported_model
    │   ├── QuantizationUnsupportedError  unsupported_quantization: a --quant mode bitsandbytes cannot run here
    │   ├── SparsityUnsupportedError  unsupported_sparsity: activation sparsity on a non-ReLU or quantized MLP
    │   └── DeviceUnavailableError  device           --device names a device this machine or torch build lacks
    ├── RequestError                                  a request a node refuses; travels back over the wire
    │   ├── BadRequestError         bad_request      malformed message, wrong shape/dtype, NaN/Inf, bad position
    │   │   ├── MessageTooLargeError  too_large      a frame over the node's byte limit, refused before it is read
    │   │   └── WrongBlocksError    wrong_blocks     blocks outside the node's span (a stale record: it moved)
    │   ├── CacheBudgetError        cache_budget     the session does not fit the node's KV cache budget
    │   ├── SessionNotFoundError    unknown_session
    │   ├── TooManySessionsError    too_many_sessions  the node's session limit, or it is draining
    │   ├── QuotaExceededError      quota            one peer's share of sessions, cache or queued steps used up
    │   ├── AdapterBudgetError      adapter_budget   an adapter does not fit the node's adapter budget (pinned/preloaded)
    │   └── AdapterError            adapter          a LoRA adapter that cannot be read or does not fit the model/span
    │       ├── UnsupportedAdapterError  unsupported_adapter  a PEFT feature nesa-node does not serve (DoRA, bias, ...)
    │       ├── AdapterHashError    adapter_hash     slice or manifest bytes whose sha256 is not the expected (tampered)
    │       └── AdapterMissingError  adapter_missing  no node (or not this node) holds the adapter a request names
    ├── PeerUnavailableError        peer_unavailable a peer did not answer in time or closed the stream
    │   ├── SessionPreemptedError   preempted        a full node ended an idle session, or took lent cache back
    │   ├── StepTimeoutError        step_timeout     a node did not compute a step within its step timeout
    │   └── ReplicaUnavailableError  replica_unavailable  a data-parallel replica sent no gradients in time
    ├── CheckpointError             checkpoint       a training checkpoint missing, damaged, or not signed by its node
    ├── NoRouteError                no_route         no chain of online nodes covers every block
    ├── NoConsensusError            no_consensus     replicas of a span gave outputs no strict majority agrees on
    ├── PlotsUnavailableError       plots_unavailable  a chart asked for without matplotlib (the `plots` extra)
    ├── CkksError                   ckks             the CKKS demo: TenSEAL missing, a secret key sent to the server, a
    │                                                product wider than the slots, bytes that are no ciphertext
    ├── SessionStateError           session_state    client-side misuse of an inference session
    ├── PortInUseError              port_in_use      a port this process must listen on is taken
    ├── IdentityFileError           identity         an identity key file that is a link, not ours, or unreadable
    ├── InitialPeersError           initial_peers    --initial-peers malformed, or none of them answered
    ├── TrainingDataError           training_data    a fine-tuning data file missing, empty or malformed
    ├── ReceiptError                receipt          a hop record, commitment or receipts file that does not decode
    ├── WeightsManifestError        weights_manifest a weights manifest file that cannot be read or is not one
    └── SchemaBookError             schema_book      a topology schema book or swarm recording that cannot be read

Errors that cross the wire are sent as (code, message) and rebuilt on the other side by `error_from_code`.
"""

from __future__ import annotations


class NesaError(Exception):
    code = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class ModelLoadError(NesaError):
    code = "model_load"


class UnsupportedModelError(ModelLoadError):
    code = "unsupported_model"


class QuantizationUnsupportedError(ModelLoadError):
    code = "unsupported_quantization"


class SparsityUnsupportedError(ModelLoadError):
    """Activation sparsity (sharding/sparsity.py) asked of a model whose MLP neurons are never exactly zero (SiLU,
    GELU: only ReLU-family activations are), or whose MLP weights are quantized and cannot be gathered by neuron."""

    code = "unsupported_sparsity"


class DeviceUnavailableError(ModelLoadError):
    code = "device"


class RequestError(NesaError):
    code = "request"


class BadRequestError(RequestError):
    code = "bad_request"


class MessageTooLargeError(BadRequestError):
    code = "too_large"


class WrongBlocksError(BadRequestError):
    code = "wrong_blocks"


class NotFiniteError(BadRequestError):
    """A training node's blocks gave values that are not finite from finite ones it was sent (hidden states or a
    gradient so large they overflow): it takes no step on them, and the client blames whoever sent them."""

    code = "not_finite"


class CacheBudgetError(RequestError):
    code = "cache_budget"


class SessionNotFoundError(RequestError):
    code = "unknown_session"


class TooManySessionsError(RequestError):
    code = "too_many_sessions"


class QuotaExceededError(RequestError):
    code = "quota"


class AdapterBudgetError(RequestError):
    """A LoRA adapter does not fit the node's adapter budget, even with every adapter no open session uses and no
    operator preloaded evicted (nesa_node/server/adapter_store.py)."""

    code = "adapter_budget"


class AdapterError(RequestError):
    """A LoRA adapter (folder or slice) that cannot be read, or does not fit the model or the span it is used on.

    A request error because a request or a peer names the adapter; an operator's --adapters folder raises it too."""

    code = "adapter"


class UnsupportedAdapterError(AdapterError):
    code = "unsupported_adapter"


class AdapterHashError(AdapterError):
    code = "adapter_hash"


class AdapterMissingError(AdapterError):
    """The adapter a session names is not held here (a node: route to one that announces it), or no node announces
    an adapter of that name (a client)."""

    code = "adapter_missing"


class WeightsManifestError(NesaError):
    """A weights manifest (per-block weight hashes of a model, sharding/weights_manifest.py) that cannot be read or is
    not one."""

    code = "weights_manifest"


class CanaryFileError(NesaError):
    """A known-answer canary file (`nesa-node model canaries`, verification/canaries.py) that cannot be read, is not
    one, or is of another model (other number of blocks or hidden size); or verify="canary:P" without one."""

    code = "canaries"


class SchemaBookError(NesaError):
    """A topology schema book (`nesa-node schema build`, topology/schemas.py) or a swarm recording (`nesa-node schema
    record`) that cannot be read, is not one, or does not fit the model (another number of blocks)."""

    code = "schema_book"


class CheckpointError(NesaError):
    """A training checkpoint that is missing, incomplete, of another adapter or model, or whose files do not match
    their hashes or signatures."""

    code = "checkpoint"


class PeerUnavailableError(NesaError):
    code = "peer_unavailable"


class ReplicaUnavailableError(PeerUnavailableError):
    """A data-parallel replica of a training session did not send its gradients in time."""

    code = "replica_unavailable"


class SessionPreemptedError(PeerUnavailableError):
    """A full node ended a session to admit or grow another: an idle one, or one holding cache lent past its peer's
    share (after its step under way). The owner fails over like for a lost node."""

    code = "preempted"


class StepTimeoutError(PeerUnavailableError):
    """A node did not compute a step within its step timeout and ended the session: the owner replaces that node
    (where a node that could not hand a step on names its next node: peer_unavailable)."""

    code = "step_timeout"


class StepFailedError(PeerUnavailableError):
    """A node's blocks failed computing a step (a torch error: out of device memory, say) and it ended the session:
    the owner replaces that node."""

    code = "step_failed"


class NoRouteError(NesaError):
    code = "no_route"


class NoConsensusError(NesaError):
    """Majority verification (verify="majority:3"): the replicas of a span disagree and no output is backed by a
    strict majority of them (itself included). The step is not taken; the replicas' peer ids are in `peer_ids`."""

    code = "no_consensus"

    def __init__(self, message: str, peer_ids: tuple[str, ...] = ()):
        super().__init__(message)
        self.peer_ids = peer_ids


class PlotsUnavailableError(NesaError):
    """A chart was asked for (`nesa-node privacy-check --png`) without matplotlib (the optional `plots` extra)."""

    code = "plots_unavailable"


class CkksError(NesaError):
    """The CKKS demo (nesa_node/privacy/ckks.py) cannot serve a request: TenSEAL missing, a context holding a secret
    key sent to the server, a product wider than a ciphertext's slots, an unknown layer or operation, or bytes that
    are not a ciphertext of the session's context."""

    code = "ckks"


class SessionStateError(NesaError):
    code = "session_state"


class PortInUseError(NesaError):
    code = "port_in_use"


class InitialPeersError(NesaError):
    code = "initial_peers"

    HINT = (
        "the address of any running peer of the swarm works (a node's or the bootstrap's `listening on` line, "
        "or its --address-file)"
    )

    @classmethod
    def not_an_address(cls, address: object) -> InitialPeersError:
        return cls(
            f"{str(address)!r} is not a peer address: it should look like /ip4/HOST/tcp/PORT/p2p/PEER_ID; {cls.HINT}"
        )


class IdentityFileError(NesaError):
    code = "identity"


class TrainingDataError(NesaError):
    """`nesa-node finetune` data that cannot be trained on: a missing or unreadable file, a line that is not a JSON
    object with "text" (or "prompt" and "completion"), no records, nothing left to predict."""

    code = "training_data"


class ReceiptError(NesaError):
    """Bytes or a file that are not a hop record, an output commitment or a receipts file (nesa_node/verification):
    malformed, out of bounds, of an unknown version or not in canonical form. A peer that sends such bytes is faulty;
    a receipts file that raises it is unreadable, which `nesa-node audit` reports apart from a failed check."""

    code = "receipt"


# what a peer may say it refused with: the request's faults, a full node, a lost or ended session or replica. A code
# of an error only this process can meet (a model folder, a device, routing, a port, a local file) is not taken
# from a peer as that error: it becomes a plain RequestError carrying the code, so a peer cannot make a client
# report, say, that no route exists or that its own model failed to load
_BY_CODE = {
    cls.code: cls
    for cls in (
        RequestError,
        BadRequestError,
        MessageTooLargeError,
        WrongBlocksError,
        CacheBudgetError,
        SessionNotFoundError,
        TooManySessionsError,
        QuotaExceededError,
        AdapterBudgetError,
        AdapterError,
        UnsupportedAdapterError,
        AdapterHashError,
        AdapterMissingError,
        ReplicaUnavailableError,
        PeerUnavailableError,
        SessionPreemptedError,
        StepTimeoutError,
        StepFailedError,
        NotFiniteError,
    )
}


def error_from_code(code: str, message: str) -> NesaError:
    """Rebuild an error received from a peer; unknown codes, and those of errors a peer cannot cause here (see
    _BY_CODE), become a generic RequestError that keeps the code."""
    cls = _BY_CODE.get(code, RequestError)
    error = cls(message)
    if cls is RequestError and code != RequestError.code:
        error.code = code
    return error
