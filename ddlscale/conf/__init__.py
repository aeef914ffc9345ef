"""ddlscale's Hydra config groups. A package (this file) because Hydra's ``pkg://ddlscale.conf`` search
path entry only reads packages; the YAML files beside it ship as package data."""
