"""A KV cache registered with a NIXL agent: the tensors' memory, and the block geometry a peer reads by."""


class CacheRegion:
    """One engine's KV cache tensors registered with a NIXL agent, and their block geometry."""

    def __init__(self, agent, llm):
        self.tensors = [t for pair in llm.runner.kv_caches for t in pair]
        self.num_blocks = self.tensors[0].shape[0]
        self.block_bytes = self.tensors[0][0].numel() * self.tensors[0].element_size()
        self.mem_type = "VRAM" if self.tensors[0].is_cuda else "DRAM"
        self.device_id = self.tensors[0].device.index or 0
        self.agent = agent
        self.reg = agent.register_memory(self.tensors)

    def deregister(self) -> None:
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None

    def describe(self) -> dict:
        return {"bases": [t.data_ptr() for t in self.tensors], "block_bytes": self.block_bytes,
                "num_blocks": self.num_blocks, "device_id": self.device_id}
