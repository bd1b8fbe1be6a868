"""Layer 6, a Llama-family model over the ops and the engine's cache: GGUF files read into host weights (gguf_file),
their byte-level BPE tokenizer and chat template (tokenizer), the architectures' settings (llama), the float64 numpy
forward of the same weights (reference), the engine that batches a stream of requests into steps (engine, with the
requests' settings and outputs in params and a step's rows in batch) and the runner that runs a step on the device
(runner).

The optional dependencies (the ``models`` extra: gguf, tokenizers) are imported when a file is read or a tokenizer
built, so that the package imports without them. Its public names are pagedvk's (`load_model`, `ModelRunner`):

    model = pagedvk.load_model("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pagedvk.ModelRunner(model, max_context=512) as runner:
        for tokens in runner.generate([model.tokenizer.encode("Hello")], max_new_tokens=20):
            print(model.tokenizer.decode(tokens))

A stream of requests (pagedvk.serve puts it behind an HTTP API):

    engine = LLMEngine(pagedvk.ModelRunner(model, max_batch=8, max_context=1024))
    engine.add_request("a", model.tokenizer.encode("Hello"), SamplingParams(max_tokens=20, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
"""
