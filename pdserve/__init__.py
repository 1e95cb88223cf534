"""pdserve: disaggregated prefill/decode LLM serving. The `pdserve` command lives in cli.py."""
