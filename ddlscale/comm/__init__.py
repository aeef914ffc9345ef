"""Accounted collectives and the volumes they charge."""

from ddlscale.comm.collectives import CollectiveRecord, CommLedger, Communicator, Pending

__all__ = ["CollectiveRecord", "CommLedger", "Communicator", "Pending"]
