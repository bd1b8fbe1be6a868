"""Layer 6, a Llama-family model over the ops and the engine's cache: GGUF files read into host weights (gguf_file),
their byte-level BPE tokenizer and chat template (tokenizer), the architectures' settings (llama), the float64 numpy
forward of the same weights (reference) and the runner that prefills and decodes on the device (runner).

The optional dependencies (the ``models`` extra: gguf, tokenizers) are imported when a file is read or a tokenizer
built, so that the package imports without them. Its public names are pagedvk's (`load_model`, `ModelRunner`):

    model = pagedvk.load_model("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pagedvk.ModelRunner(model, max_context=512) as runner:
        for tokens in runner.generate([model.tokenizer.encode("Hello")], max_new_tokens=20):
            print(model.tokenizer.decode(tokens))
"""
