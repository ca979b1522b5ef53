"""``cdb bench serve``: the open-loop serving benchmark for looped models (see ``cdb_bench.serve.cli``).

Modules: ``arrivals`` (Poisson and gamma arrival processes), ``lengths`` (ShareGPT- and Alpaca-like length fits),
``datasets`` (prompts from ShareGPT JSON or JSONL files), ``requests`` (the seeded request list, the same for every
mode), ``driver`` (the asyncio open-loop client, with an optional cap on requests in flight), ``targets``
(in-process engine or a deployment through the public gRPC API), ``openai_target`` (any OpenAI-compatible server
over streamed HTTP), ``metrics`` (per-request latencies and per-run summaries), ``vllm_fields`` (the same figures
under vLLM's result names), ``knee`` (capacity knee by bisection), ``sweep`` (modes x rates), ``remote`` (the
``--base-url`` runs), ``report`` (table, JSON, plots), ``options`` (option types, ``--quick``), ``setup`` (a local
run's engine config, request set and result header), ``cli`` (the command).
"""
