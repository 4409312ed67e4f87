"""`specgen bench`: prompt sets (prompts.py), the methods and their runners (methods.py,
runners.py, references.py for transformers, llamacpp.py for llama.cpp), measuring
(measure.py), summaries (summary.py), throughput cells (throughput.py) and reports (report.py)."""
