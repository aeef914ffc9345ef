"""``python -m ddlscale.ckpt.gemini.agent``: run one machine's replica agent."""

from ddlscale.ckpt.gemini.agent import main

main()
