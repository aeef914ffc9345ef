"""Accounted collectives, the volumes they charge, and the network model that prices them (:mod:`.network`)."""

from ddlscale.comm.collectives import CollectiveRecord, CommLedger, Communicator, Pending

__all__ = ["CollectiveRecord", "CommLedger", "Communicator", "Pending"]
