"""Choosing tokens: request parameters (params.py: SamplingParams, the request errors), the
batch sampler (sampler.py: temperature / top-k / top-p / min-p races, logprobs), penalties and
logit bias (penalties.py), and grammar-constrained output (grammar.py, xgrammar: compiled in a
pool of child processes, compile_pool.py, each a grammar_worker.py child within its budgets).
The parameters import nothing from workers; the sampler imports the parameters."""
