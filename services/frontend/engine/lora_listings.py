"""The LoRA adapters a frontend lets requests name: those every engine replica lists.

Each replica's newest listing comes with its StatsSnapshots and with the answers to loads and
unloads (by another way, so either may overtake the other: the newer version wins). A load is
named on every replica before it is answered (services/tokenizer/lora_fanout.py); an adapter
that one replica lacks (gone with a replaced executor) is not offered at all, so a request
for it gets 404 here rather than an error from whichever replica it would reach.
"""

from __future__ import annotations

from shared.lora_modules import LoraModule, static_adapters
from shared.protocol import LoraAdapterInfo, LoraAdapterListing


class LoraListings:
    def __init__(self, modules: list[LoraModule]) -> None:
        # Until a replica says: those of --lora-modules.
        self.adapters: dict[str, LoraAdapterInfo] = static_adapters(modules)
        self.by_replica: dict[int, LoraAdapterListing] = {}

    def take(self, listing: LoraAdapterListing) -> None:
        known = self.by_replica.get(listing.replica)
        if known is not None and known.version > listing.version:
            return
        self.by_replica[listing.replica] = listing
        first, *others = (self.by_replica[r] for r in sorted(self.by_replica))
        held = [{(a.name, a.lora_id) for a in other.adapters} for other in others]
        self.adapters = {
            a.name: a for a in first.adapters if all((a.name, a.lora_id) in ids for ids in held)
        }

    def holders(self, name: str) -> list[int]:
        """The replicas that list an adapter of that name."""
        return sorted(
            replica
            for replica, listing in self.by_replica.items()
            if any(adapter.name == name for adapter in listing.adapters)
        )
