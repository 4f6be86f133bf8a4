"""Mutation campaigns: does a check notice a planted fault?

``mutant`` (a runtime patch of the reference: the reference code stays clean), ``catalogue``,
``catalogue_manager``, ``catalogue_scheduler`` (the reference's faults), ``torch_catalogue`` (the
torch implementation's), ``campaign`` (runs checks against each and reports kills), and
``vllm_source`` (source-level faults in a copy of the installed vLLM).
"""
