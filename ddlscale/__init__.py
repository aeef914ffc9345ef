"""ddlscale: scaling distributed training by optimizing its communication.

Four systems behind one Lightning strategy: Zen (sparse gradient sync), Espresso (per-tensor
compression plans), Cupcake (fusion for compression) and Gemini (in-memory checkpoints).
"""

__version__ = "0.1.0"
