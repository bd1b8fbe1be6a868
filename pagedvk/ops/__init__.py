"""Layer 3, the ops: decode (rules, plan, one-call path), prefill and backward, cache writes and block copies, the
merge of attention states, attention variants, argument checks, and vLLM's spellings of them all (vllm). Each op
chooses its kernel module, packs its arguments and launches it through pagedvk.kernels and pagedvk.runtime."""
