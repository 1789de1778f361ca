"""The step message: what rank 0 sends the workers for one step (the block moves, then the forward's
inputs), packed into one int64 tensor. The header is derived from the fields, in their order: an int
field's value, a tensor's dtype and shape (or absence), a list's length and then its tensors'."""
import dataclasses

import torch

from ..kv.recent import from_wire, to_wire
from ..models.layers import AttentionMetadata, KVGroupInputs

# What a field is on the wire (its dataclass metadata).
INT, TENSOR, TENSOR_LIST = "int", "tensor", "tensor list"
DTYPES = (torch.int64, torch.int32)     # the header names a tensor's dtype by its index here
ABSENT = -1                             # the header's dtype of a tensor field that is None
MOVES = ("swap_in", "swap_out", "copies", "offloads", "loads")   # the block-move fields, [n, 2] each


def _field(wire: str, **kwargs):
    return dataclasses.field(metadata={"wire": wire}, **kwargs)


def _moves(pairs) -> torch.Tensor:
    """Block pairs (a list of (a, b) or an [n, 2] tensor) as an [n, 2] int64 tensor."""
    return torch.as_tensor(pairs, dtype=torch.int64).view(-1, 2)


@dataclasses.dataclass
class StepMessage:
    swap_in: torch.Tensor = _field(TENSOR)      # [n, 2] (cpu block, gpu block)
    swap_out: torch.Tensor = _field(TENSOR)     # [n, 2] (gpu block, cpu block)
    copies: torch.Tensor = _field(TENSOR)       # [n, 2] copy-on-write (src, dst)
    offloads: torch.Tensor = _field(TENSOR)     # [n, 2] to the host tier (gpu block, host slot)
    loads: torch.Tensor = _field(TENSOR)        # [n, 2] from the host tier (host slot, gpu block)
    input_ids: torch.Tensor | None = _field(TENSOR, default=None)      # [T]; None: blocks move only
    positions: torch.Tensor | None = _field(TENSOR, default=None)      # [T]
    seq_lens: torch.Tensor | None = _field(TENSOR, default=None)       # [B] int32
    query_start_loc: torch.Tensor | None = _field(TENSOR, default=None)  # [B + 1] int32
    logits_indices: torch.Tensor | None = _field(TENSOR, default=None)   # [R] (None: each sequence's last)
    max_seq_len: int = _field(INT, default=0)
    slot_mappings: list = _field(TENSOR_LIST, default_factory=list)  # per KV group: [T] int64
    block_tables: list = _field(TENSOR_LIST, default_factory=list)   # per KV group: [B, M_g] int32
    recent: list = _field(TENSOR_LIST, default_factory=list)         # the float8 rule's (kv.recent.to_wire)

    @classmethod
    def of(cls, moves, step=None) -> "StepMessage":
        """The message of a step: its block moves (a ScheduledBatch's), and `step`, the runner's (input_ids,
        positions, AttentionMetadata) or None when no sequence runs."""
        moves = {name: _moves(getattr(moves, name)) for name in MOVES}
        if step is None:
            return cls(**moves)
        input_ids, positions, meta = step
        return cls(**moves, input_ids=input_ids, positions=positions, seq_lens=meta.seq_lens,
                   query_start_loc=meta.query_start_loc, logits_indices=meta.logits_indices,
                   max_seq_len=meta.max_seq_len, slot_mappings=[g.slot_mapping for g in meta.groups],
                   block_tables=[g.block_tables for g in meta.groups], recent=to_wire(meta.recent))

    def step(self):
        """The runner's (input_ids, positions, AttentionMetadata), or None when the step moves blocks only."""
        if self.input_ids is None:
            return None
        meta = AttentionMetadata(seq_lens=self.seq_lens, query_start_loc=self.query_start_loc,
                                 max_seq_len=self.max_seq_len, logits_indices=self.logits_indices,
                                 groups=[KVGroupInputs(s, t) for s, t in zip(self.slot_mappings, self.block_tables)],
                                 recent=from_wire(self.recent))
        return self.input_ids, self.positions, meta

    def pack(self) -> torch.Tensor:
        """[header length, header, every tensor's elements] as one int64 tensor on the CPU."""
        header, data = [], []

        def put(t):
            if t is None:
                header.append(ABSENT)
                return
            header.extend([DTYPES.index(t.dtype), t.dim(), *t.shape])
            data.append(t.reshape(-1).to("cpu", torch.int64))

        for f in dataclasses.fields(self):
            value, wire = getattr(self, f.name), f.metadata["wire"]
            if wire == INT:
                header.append(value)
            elif wire == TENSOR:
                put(value)
            else:
                header.append(len(value))
                for t in value:
                    put(t)
        return torch.cat([torch.tensor([len(header), *header], dtype=torch.int64), *data])

    @classmethod
    def unpack(cls, packed: torch.Tensor, device: torch.device | str = "cpu") -> "StepMessage":
        """The message pack() made, its tensors on `device`."""
        n = int(packed[0])
        header = iter(packed[1:1 + n].tolist())
        specs = []           # (dtype, shape) of each tensor present, in order

        def take():
            code = next(header)
            if code == ABSENT:
                return None
            shape = [next(header) for _ in range(next(header))]
            specs.append((DTYPES[code], shape))
            return len(specs) - 1

        layout = {}
        for f in dataclasses.fields(cls):
            wire = f.metadata["wire"]
            if wire == INT:
                layout[f.name] = next(header)
            elif wire == TENSOR:
                layout[f.name] = take()
            else:
                layout[f.name] = [take() for _ in range(next(header))]
        sizes = [torch.Size(shape).numel() for _, shape in specs]
        parts = packed[1 + n:].to(device).split(sizes)
        tensors = [p.view(shape).to(dtype) for p, (dtype, shape) in zip(parts, specs)]

        def value(f):
            index, wire = layout[f.name], f.metadata["wire"]
            if wire == INT:
                return index
            if wire == TENSOR:
                return None if index is None else tensors[index]
            return [tensors[i] for i in index]
        return cls(**{f.name: value(f) for f in dataclasses.fields(cls)})
