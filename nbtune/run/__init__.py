"""The run: what drives training (the contract a trainer and a run provide, ``protocol``)."""
