"""ddlscale's Hydra plug-ins: the sweeper that checks every job before the first starts."""
