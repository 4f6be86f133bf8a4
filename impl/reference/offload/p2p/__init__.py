"""kvref.impl.reference.offload.p2p — vLLM's P2P secondary offload tier, readable.

Two engines share offloaded KV chunks peer to peer (vLLM ``vllm/v1/kv_offload/tiering/p2p/``): a
producer stores a request's chunks and a consumer fetches them over a session protocol on a
control connection, the bytes moving on a data plane. :mod:`.messages` is the protocol,
:mod:`.client` and :mod:`.server` the two roles of a session, :mod:`.session` the handshake and
dispatch, :mod:`.transport` the data plane's contract, :mod:`.manager` the tier's bookkeeping of
which kv_request_ids are parked, bound, reaped or failed, and :mod:`.world` two engines and the
network between them.
"""
