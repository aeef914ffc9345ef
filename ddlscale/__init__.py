"""ddlscale: scaling distributed training by optimizing its communication.

Four systems behind one Lightning strategy: Zen (sparse gradient sync), Espresso (per-tensor
compression plans), Cupcake (fusion for compression) and Gemini (in-memory checkpoints).
Importing the package registers the strategy with Lightning: ``Trainer(strategy="ddlscale")``.
"""

__version__ = "0.1.0"

from ddlscale import strategy as _strategy  # noqa: E402, F401  (registers "ddlscale" with Lightning)
