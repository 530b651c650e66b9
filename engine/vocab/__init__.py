"""The engine's torch-free vocabulary: the types and rules that the frontend,
the prefix index and the workers' protobuf edge share with the engine.

    hashing          the one chained block hash (invariant 1)
    sampling_params  SamplingParams, validated; the greedy threshold
    guided_params    structured-output specs, validated
    cache_events     what entered or left a worker's prefix cache
    logprobs         a generated position's logprobs, as the engine hands them back
    models           where a model lives on disk and what it is called
    lora_request     which LoRA adapter a request uses (name, path, digest)
    tokenizer        encode / decode / vocabulary without transformers (tokenizer.json)

Nothing here imports torch or the rest of the engine (tests/unit/test_architecture.py
checks it), so importing it costs milliseconds.  See docs/ARCHITECTURE.md.
"""
