"""The gateway's adapter loads (gateway/adapters.py GatewayAdapters.load): concurrent loads cannot pass the bound on
loaded adapters together, and a name loaded again from another folder does not keep the old adapter in memory."""

from __future__ import annotations

import asyncio

import pytest

from nesa_node.errors import AdapterError
from nesa_node.gateway import adapters
from nesa_node.gateway.adapters import GatewayAdapters, LoadAdapter


class Reader:
    """What GatewayAdapters asks of its model for a load: the folder read (slow, as a big adapter's is) into
    `own_adapters` under an id of its own."""

    def __init__(self):
        self.own_adapters: dict[str, str] = {}
        self.reads = 0

    async def resolve_adapter(self, folder: str) -> str:
        self.reads += 1
        await asyncio.sleep(0.02)
        adapter_id = f"{abs(hash(folder)):064x}"[-64:]
        self.own_adapters[adapter_id] = folder
        return adapter_id


def test_concurrent_loads_cannot_pass_the_bound_together(tmp_path, monkeypatch):
    monkeypatch.setattr(adapters, "MAX_LOADED", 3)
    for index in range(8):
        (tmp_path / f"a{index}").mkdir()
    reader = Reader()
    gateway = GatewayAdapters(reader, base_name="base", adapter_dir=str(tmp_path))

    async def run():
        loads = [gateway.load(LoadAdapter(name=f"n{index}", path=f"a{index}")) for index in range(8)]
        return await asyncio.gather(*loads, return_exceptions=True)

    answers = asyncio.run(run())
    refused = [answer for answer in answers if isinstance(answer, AdapterError)]
    assert len(refused) == 5 and all("3 adapters are loaded already" in answer.message for answer in refused)
    assert len(gateway.loaded) == 3 and len(reader.own_adapters) == 3 and reader.reads == 3


def test_a_name_loaded_again_from_another_folder_drops_the_old_adapter(tmp_path):
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    reader = Reader()
    gateway = GatewayAdapters(reader, base_name="base", adapter_dir=str(tmp_path))

    async def run():
        first = await gateway.load(LoadAdapter(name="mine", path="first"))
        await gateway.load(LoadAdapter(name="alias", path="first"))  # the same adapter under a second name
        second = await gateway.load(LoadAdapter(name="mine", path="second"))
        kept_for_alias = first["id"] in reader.own_adapters
        await gateway.load(LoadAdapter(name="alias", path="second"))
        return first["id"], second["id"], kept_for_alias

    first, second, kept_for_alias = asyncio.run(run())
    assert first != second and kept_for_alias  # still loaded under the other name
    assert set(reader.own_adapters) == {second} and gateway.loaded == {"mine": second, "alias": second}
    with pytest.raises(PermissionError):
        asyncio.run(gateway.load(LoadAdapter(name="out", path="../elsewhere")))
