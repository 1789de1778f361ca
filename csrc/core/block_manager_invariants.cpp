// Block manager: check_invariants. Each part checks its own state (BlockPool, Pins, PendingCopies); this
// file checks what spans parts: the sequences' tables against the pools' reference counts, and the
// prefix cache against the blocks' content tags.
#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "core/block_manager.h"
#include "core/errors.h"

namespace pagedkv {
namespace {

[[noreturn]] void fail(const std::string& what) { throw InvariantError("BlockManager invariant violated: " + what); }

}  // namespace

void BlockManager::check_invariants() const {
  // Reference counts equal the number of block-table entries and pins that point at each block.
  std::vector<int32_t> gpu_uses(num_blocks(), 0), cpu_uses(num_cpu_blocks(), 0);
  for (const auto& [id, seq] : seqs_) check_sequence(id, seq, &gpu_uses, &cpu_uses);
  pins_.check_invariants();
  pins_.add_uses(&gpu_uses);
  // Pending offloads and loads hold their device blocks and host slots.
  std::vector<int32_t> host_uses(host_.pool().num_blocks(), 0);
  host_.add_uses(&gpu_uses, &host_uses);
  // Pending disk writes and reads hold their host slots and disk records.
  std::vector<int32_t> disk_uses(disk_.pool().num_blocks(), 0);
  disk_.add_uses(&host_uses, &disk_uses);
  for (int32_t r = 0; r < disk_.pool().num_blocks(); ++r)
    if (disk_.pool().ref_count(r) != disk_uses[r])
      fail(cat("disk record ", r, " has ref_count ", disk_.pool().ref_count(r), " but ", disk_uses[r], " uses"));
  for (int32_t b = 0; b < host_.pool().num_blocks(); ++b)
    if (host_.pool().ref_count(b) != host_uses[b])
      fail(cat("host slot ", b, " has ref_count ", host_.pool().ref_count(b), " but ", host_uses[b], " uses"));
  for (int32_t b = 0; b < num_blocks(); ++b)
    if (gpu_.ref_count(b) != gpu_uses[b])
      fail(cat("block ", b, " has ref_count ", gpu_.ref_count(b), " but ", gpu_uses[b], " uses"));
  for (int32_t b = 0; b < num_cpu_blocks(); ++b)
    if (cpu_.ref_count(b) != cpu_uses[b])
      fail(cat("CPU block ", b, " has ref_count ", cpu_.ref_count(b), " but ", cpu_uses[b], " uses"));
  gpu_.check_invariants();
  cpu_.check_invariants();
  copies_.check_invariants(num_blocks());
  host_.check_invariants();
  disk_.check_invariants();
  int32_t loading = 0, readmit = 0;
  for (const auto& [id, seq] : seqs_) {
    loading += seq.loading;
    readmit += seq.readmit;
    if (seq.readmit && (seq.loading > 0 || seq.num_computed != 0 || seq.swapped))
      fail(cat(seq_str(id), " waits to be re-admitted but is loading, swapped or has computed tokens"));
    if (seq.loading == 0 && seq.load_failed_at >= 0) fail(cat(seq_str(id), " keeps a failed load after its loads"));
    if (seq.loading > 0 && (!loading_seqs_.count(seq.serial) || loading_seqs_.at(seq.serial) != id))
      fail(cat(seq_str(id), " has ", seq.loading, " loads pending but is not listed as loading"));
  }
  if (loading_seqs_.size() > seqs_.size()) fail("a freed sequence is still listed as loading");
  if (readmit != num_readmit_) fail(cat(readmit, " sequences wait to be re-admitted but the count says ", num_readmit_));
  if (loading > host_.num_loads_queued() + host_.num_loads_in_flight())
    fail(cat("sequences wait for ", loading, " loads but only ", host_.num_loads_queued() + host_.num_loads_in_flight(),
             " are pending"));
  check_prefix_cache();
}

void BlockManager::check_sequence(int64_t id, const Sequence& seq, std::vector<int32_t>* gpu_uses,
                                  std::vector<int32_t>* cpu_uses) const {
  const int64_t len = static_cast<int64_t>(seq.tokens.size());
  if (seq.num_computed < 0 || seq.num_computed > len)
    fail(cat(seq_str(id), " has num_computed=", seq.num_computed, " outside [0, ", len, "]"));
  if (static_cast<int32_t>(seq.groups.size()) != num_groups())
    fail(cat(seq_str(id), " has ", seq.groups.size(), " group tables for ", num_groups(), " groups"));
  for (int32_t g = 0; g < static_cast<int32_t>(seq.groups.size()); ++g) {
    const GroupTable& t = seq.groups[g];
    const std::string where = cat(seq_str(id), " group ", g);
    const int64_t size = static_cast<int64_t>(t.blocks.size());
    // All of its tokens' blocks, or (a prompt prefilled in chunks) at least those of its computed tokens.
    if (size > blocks_for_tokens(len) || size < std::max<int64_t>(blocks_for_tokens(seq.num_computed), t.released) ||
        t.blocks.size() != seq.groups[0].blocks.size())
      fail(cat(where, " has ", t.blocks.size(), " blocks for ", len, " tokens (", seq.num_computed, " computed)"));
    // A sequence waiting to be re-admitted keeps its table as it was (nothing reads it; free releases it).
    if (t.released != released_for(g, seq.num_computed) && !seq.readmit)
      fail(cat(where, " released ", t.released, " blocks but its window releases ", released_for(g, seq.num_computed),
               " at ", seq.num_computed, " computed tokens"));
    // Held: at most the window's blocks, the block being written and the tokens not yet computed.
    if (group_windows()[g] != kFullAttention && !seq.readmit &&
        size - t.released > window_blocks(g, blocks_for_tokens(len - seq.num_computed)))
      fail(cat(where, " holds ", t.blocks.size() - t.released, " blocks, more than its window needs"));
    if (int64_t(t.num_registered) * block_size_ > seq.num_computed)
      fail(cat(where, " registered ", t.num_registered, " blocks beyond its computed tokens"));
    for (int32_t i = 0; i < t.released; ++i)
      if (t.blocks[i] != kPad) fail(cat(where, " released entry ", i, " holds ", t.blocks[i], " instead of the pad"));
    std::vector<int32_t>& uses = *(seq.swapped ? cpu_uses : gpu_uses);
    for (size_t i = static_cast<size_t>(t.released); i < t.blocks.size(); ++i) {
      const int32_t b = t.blocks[i];
      if (b < 0 || b >= static_cast<int32_t>(uses.size())) fail(cat(where, " holds out-of-range block ", b));
      ++uses[b];
    }
    if (!seq.swapped) check_registered_chain(id, seq, g);
  }
}

// Registered held blocks carry exactly this sequence's content, and their chain its prefix, from the
// group's root.
void BlockManager::check_registered_chain(int64_t id, const Sequence& seq, int32_t group) const {
  const GroupTable& t = seq.groups[group];
  const std::string where = cat(seq_str(id), " group ", group);
  const int32_t last = t.num_registered - 1;
  if (last < t.released) return;
  PrefixCache::NodeId node = gpu_.tag(t.blocks[last]);
  for (int32_t i = last; i >= 0; --i) {
    if (node == PrefixCache::kNoNode || PrefixCache::is_root(node))
      fail(cat(where, " block ", i, " is registered but its chain has no content there"));
    if (i >= t.released && gpu_.tag(t.blocks[i]) != node)
      fail(cat(where, " block ", i, " is tagged with content other than its chain's"));
    const auto& n = cache_.node(node);
    const int64_t* block_tokens = seq.tokens.data() + int64_t(i) * block_size_;
    if (!std::equal(block_tokens, block_tokens + block_size_, cache_.tokens(node)) || (i == 0 && n.salt != seq.salt))
      fail(cat(where, " block ", i, " is tagged with content that differs from its tokens or prefix"));
    node = n.parent;
  }
  if (node != PrefixCache::root(group)) fail(cat(where, "'s registered chain does not start at the group's root"));
}

// Prefix cache: node references (tagged blocks and child nodes), registrations and the hash index agree.
void BlockManager::check_prefix_cache() const {
  const std::vector<PrefixCache::NodeId> live = cache_.live_nodes();
  std::unordered_map<PrefixCache::NodeId, int32_t> refs;
  const std::unordered_set<PrefixCache::NodeId> live_set(live.begin(), live.end());
  for (int32_t b = 0; b < num_blocks(); ++b) {
    const PrefixCache::NodeId tag = gpu_.tag(b);
    if (tag == PrefixCache::kNoNode) continue;
    if (!live_set.count(tag)) fail(cat("block ", b, " is tagged with a freed prefix-cache node"));
    ++refs[tag];
  }
  const BlockPool& host = host_.pool();
  for (int32_t s = 0; s < host.num_blocks(); ++s) {
    const PrefixCache::NodeId tag = host.tag(s);
    if (tag == PrefixCache::kNoNode) continue;
    if (!live_set.count(tag)) fail(cat("host slot ", s, " is tagged with a freed prefix-cache node"));
    if (cache_.node(tag).host_slot != s) fail(cat("host slot ", s, " holds content its node does not name"));
    ++refs[tag];
  }
  const BlockPool& disk = disk_.pool();
  for (int32_t r = 0; r < disk.num_blocks(); ++r) {
    const PrefixCache::NodeId tag = disk.tag(r);
    if (tag == PrefixCache::kNoNode) continue;
    if (!live_set.count(tag)) fail(cat("disk record ", r, " is tagged with a freed prefix-cache node"));
    if (cache_.node(tag).disk_record != r) fail(cat("disk record ", r, " holds content its node does not name"));
    ++refs[tag];
  }
  for (PrefixCache::NodeId id : live) {  // pending offloads, disk writes and disk reads hold their nodes
    const auto& n = cache_.node(id);
    refs[id] += n.offloading + n.disk_writing + n.disk_reading;
  }
  int32_t registered = 0, host_registered = 0, disk_registered = 0;
  for (PrefixCache::NodeId id : live) {
    const auto& n = cache_.node(id);
    if (!PrefixCache::is_root(n.parent)) ++refs[n.parent];
    if (n.root > PrefixCache::kRoot || n.root < PrefixCache::root(num_groups() - 1) ||
        n.root != (PrefixCache::is_root(n.parent) ? n.parent : cache_.node(n.parent).root))
      fail(cat("prefix-cache node ", id, " has root ", n.root, " which is not its chain's group root"));
    if (!cache_.indexed(id)) fail(cat("prefix-cache node ", id, " is missing from the hash index"));
    if (n.block != PrefixCache::kNoBlock) {
      ++registered;
      if (gpu_.tag(n.block) != id) fail(cat("prefix-cache node ", id, " names block ", n.block, " which holds other content"));
    }
    if (n.host_slot != PrefixCache::kNoBlock) {
      ++host_registered;
      if (host.tag(n.host_slot) != id)
        fail(cat("prefix-cache node ", id, " names host slot ", n.host_slot, " which holds other content"));
    }
    if (n.disk_record != PrefixCache::kNoBlock) {
      ++disk_registered;
      if (disk.tag(n.disk_record) != id)
        fail(cat("prefix-cache node ", id, " names disk record ", n.disk_record, " which holds other content"));
    }
  }
  for (PrefixCache::NodeId id : live)
    if (cache_.node(id).refs != refs[id])
      fail(cat("prefix-cache node ", id, " has refs ", cache_.node(id).refs, " but ", refs[id], " referrers"));
  if (registered != cache_.num_registered()) fail("prefix-cache registration count is wrong");
  if (host_registered != cache_.num_registered(Medium::kCpu)) fail("prefix-cache host registration count is wrong");
  if (disk_registered != cache_.num_registered(Medium::kDisk)) fail("prefix-cache disk registration count is wrong");
}

}  // namespace pagedkv
