"""Model runtime: plain ``nn.Module``s with an explicit paged-attention forward.

    loader.load_model(path, dtype, device, quantization="none", kernels=None)
        -> (model, ModelConfig)
        (projections in the weight format ``weights.quantizations.choose_weight_format`` picks;
        attention and layer ops by ``kernels``, the engine's native ones or, None, PyTorch's)
    model(input_ids [T], positions [T], AttentionMetadata, kv_caches) -> hidden [T, H]
    model.compute_logits(hidden [N, H], widen=True) -> logits [N, V] (float32 when widened)
    model.kv_cache_shape(num_blocks, block_size) -> one layer's cache shape
    perplexity.perplexity(model, token_ids) -> float (accuracy of a weight format)

Depends on torch (and the gguf / safetensors readers) only, never on the engine.
"""
