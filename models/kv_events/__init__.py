"""KV cache events as a stream: ``watch`` keeps a shadow of an engine's prefix-cache index from
its ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` batches and checks the stream's rules.
"""
