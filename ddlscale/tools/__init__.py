"""Stand-alone analysis tools run as ``python -m ddlscale.tools.<name>``."""
