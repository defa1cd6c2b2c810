"""Names of the RPCs a node registers on its P2P host, and the frame size limit of unary calls.

Streams (a Channel each, protocol/channel.py): INFERENCE (one per session), PUSH_STREAM (a node's pushes to its
next node for one session), ADAPTER (a LoRA adapter's blocks for a node that lacks them), TRAIN (one LoRA
training session), FORWARD_STREAM (one cacheless forward too large for a unary call), GRAPH_FORWARD_STREAM (one
graph stage call: what a graph pipeline uses, its tensors being of any size). Unary: INFO, PING,
FORWARD, PUSH (one pushed step), LANE_TICKET, GRAPH_FORWARD.
"""

INFO = "nesa.info"
PING = "nesa.ping"
FORWARD = "nesa.forward"
FORWARD_STREAM = "nesa.forward_stream"  # a stream: one ForwardRequest, one answer (over MAX_UNARY_BYTES)
INFERENCE = "nesa.inference"
PUSH = "nesa.push"
PUSH_STREAM = "nesa.push_stream"
LANE_TICKET = "nesa.lane_ticket"
GRAPH_FORWARD = "nesa.graph_forward"
GRAPH_FORWARD_STREAM = "nesa.graph_forward_stream"  # a stream: one GraphForward, one answer (any size)
TRAIN = "nesa.train"  # a stream: one LoRA training session (server/training.py)
TRAIN_SYNC = "nesa.train_sync"  # a stream: one replica's gradients for one update of a data-parallel training session
ADAPTER = "nesa.adapter"  # a stream: one AdapterRequest, one answer (a node fetching a LoRA adapter's blocks)

MAX_UNARY_BYTES = 4 << 20  # p2pd's bound on a unary call's request and answer (its default; larger ones fail)
MAX_PING_BYTES = 1 << 20  # what a ping may carry: room for a bandwidth probe, nothing more
