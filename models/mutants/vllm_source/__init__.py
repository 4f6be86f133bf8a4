"""Source-level faults in vLLM's own KV-cache code, applied to an overlay copy of the installed
package (:mod:`.overlay`), and the catalogue of them (:mod:`.catalogue`). The campaign that runs
``kvref verify --against vllm`` on each lives in :mod:`kvref.vllm_campaign`; see docs/vllm_mutants.md.
"""
