"""Layer 8, `pagedvk serve`: an OpenAI-compatible HTTP server over an LLMEngine. The engine steps in a thread of its
own (worker); the endpoints and their shapes are app and protocol; a sample's text with stop strings is text; uvicorn
serving an app in a thread (tests, benchmarks) is server. The package's __init__ imports none of them: FastAPI and
uvicorn, the `serve` extra, are imported by the modules that use them.

    from pagedvk.serve.app import create_app
    from pagedvk.serve.worker import EngineWorker
    runner = pagedvk.ModelRunner(pagedvk.load_model(path), max_batch=8, max_context=2048)
    worker = EngineWorker(LLMEngine(runner)).start()
    uvicorn.run(create_app(worker, "smollm2"), host="127.0.0.1", port=8000)
"""
