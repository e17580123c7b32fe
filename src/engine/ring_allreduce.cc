#include "engine/ring_allreduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "engine/small_allreduce.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
namespace {

void prescale(const SegmentedBuffer& data, float scale) {
  for (std::size_t done = 0; done < data.count();) {
    const std::size_t n = data.contiguous_from(done);
    float* values = reinterpret_cast<float*>(data.address(done));
    for (std::size_t i = 0; i < n; ++i) values[i] *= scale;
    done += n;
  }
}

void append_runs(const SegmentedBuffer& from, ElementRange range, std::vector<char*>* bases,
                 std::vector<std::size_t>* counts) {
  for (std::size_t done = 0; done < range.count;) {
    const std::size_t offset = range.offset + done;
    const std::size_t n = std::min(range.count - done, from.contiguous_from(offset));
    bases->push_back(from.address(offset));
    counts->push_back(n);
    done += n;
  }
}

// The elements of `ranges` of `from`, in that order, as one logical buffer (nothing is copied).
SegmentedBuffer select_ranges(const SegmentedBuffer& from, const std::vector<ElementRange>& ranges) {
  std::vector<char*> bases;
  std::vector<std::size_t> counts;
  for (const ElementRange& range : ranges) append_runs(from, range, &bases, &counts);
  return SegmentedBuffer(std::move(bases), counts, from.element_size());
}

// Blocks of counts[i] elements back to back.
std::vector<ElementRange> consecutive(const std::vector<std::size_t>& counts) {
  std::vector<ElementRange> ranges;
  std::size_t start = 0;
  for (std::size_t count : counts) {
    ranges.push_back({start, count});
    start += count;
  }
  return ranges;
}

Status check_counts(const std::vector<std::size_t>& counts, int world, std::size_t all, std::size_t mine, int rank) {
  std::size_t total = 0;
  for (std::size_t count : counts) total += count;
  if (counts.size() != static_cast<std::size_t>(world) || total != all || counts[rank] != mine) {
    return Status::invalid("block counts do not match the buffers (" + std::to_string(counts.size()) + " counts for " +
                           std::to_string(world) + " ranks, summing to " + std::to_string(total) + " of " +
                           std::to_string(all) + " elements)");
  }
  return Status::ok();
}

}  // namespace

Status RingAllreduce::create(Transport& transport, const std::vector<int>& dims, const std::vector<int>& order,
                             std::unique_ptr<RingAllreduce>* out) {
  RankedTorus ring;
  DDLFAST_RETURN_IF_ERROR(RankedTorus::make(dims, order, transport.size(), transport.rank(), &ring));
  out->reset(new RingAllreduce(transport, std::move(ring)));
  return Status::ok();
}

// Tiny buffers: MPI_Allreduce's log(p) steps beat the ring's 2(p-1). min, max
// and product run ddlfast's own kernels as MPI user ops (the transport's), so
// nan and signed zeros follow the same rules as on the ring.
Status RingAllreduce::run(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options) {
  if (data.count() == 0 || ring_.torus.world_size() == 1) return Status::ok();
  // Integer average and the half types' range (engine/exact_arithmetic.h): the
  // same arithmetic on the ring and on the small-message path.
  DDLFAST_RETURN_IF_ERROR(exact_.before(data, dtype, op, ring_.torus.world_size()));
  DDLFAST_RETURN_IF_ERROR(reduce(exact_.buffer(), dtype, exact_.op(), options));
  return exact_.after(transport_);
}

Status RingAllreduce::reduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const EngineOptions& options) {
  const int world = ring_.torus.world_size();
  const std::size_t count = data.count();
  const std::size_t esize = dtype_size(dtype);
  int divisor = op == ReduceOp::kAverage ? world : 1;
  if (count * esize <= options.small_bytes) return small_allreduce(transport_, data, dtype, op, divisor, options);
  DDLFAST_RETURN_IF_ERROR(check_direct(options.direct_by_dim, ring_.torus.num_dims()));
  bool compressed = false;
  DDLFAST_RETURN_IF_ERROR(prepare_wire(data, dtype == DType::kFloat32, op, options, &divisor, &compressed));
  if (options.chain) return run_chain(data, dtype, op, divisor, compressed, options);
  return run_phases(data, build_rank_schedule(ring_, count, options.direct_by_dim), dtype, op, divisor, compressed,
                    options, RingPasses::kBoth);
}

// The schedule of dims (H, G) with direct reduce-scatters: phase 0 is dimension 1's (the own block, the host's
// ranks), phase 1 dimension 2's (the peers on the other hosts); the chain replaces both and dimension 2's
// allgather (every coordinate j ends with all of block j), so only dimension 1's allgather (the last phase) is
// left. The chain's tags are phase 1's band, the allgather's phase 0's.
Status RingAllreduce::run_chain(const SegmentedBuffer& data, DType dtype, ReduceOp op, int divisor, bool compressed,
                                const EngineOptions& options) {
  DDLFAST_RETURN_IF_ERROR(check_chain(ring_.torus.dims()));
  const std::size_t chunk_elems =
      chain_chunk_elems(data.count(), ring_.torus.dims()[0],
                        std::max<std::size_t>(1, options.chunk_bytes / data.element_size()), data.element_size());
  const int slots = std::max(2, options.receives_in_flight);
  const RingSchedule schedule = build_rank_schedule(ring_, data.count(), {1, 1});
  const RingPhase& within = schedule.phases[0];
  const ChainPlan plan = chain_plan(data, within, schedule.phases[1], chunk_elems);
  const DirectChunks contributions = direct_chunks(data, within, chunk_elems);
  const double start = monotonic_seconds();
  auto chain = [&](auto wire) {
    // The chain is reproducible=True's canonical order: every contribution rounded, the owner's too.
    DirectHostSteps<decltype(wire)> steps(data, within, contributions, slots, chunk_elems, wire, &scratch_, true);
    steps.prepare_chain(plan, &scratch_);
    return run_chain_phase(transport_, within, plan, kTagsPerPhase, divisor, steps);
  };
  const int wire = compressed ? options.wire_by_dim[0] : -1;
  if (wire >= 0) {
    DDLFAST_RETURN_IF_ERROR(chain(HalfWire(wire, op, &scratch_.decoded, &overflows_)));
  } else if (sums_halves_in_float32(dtype, op)) {
    DDLFAST_RETURN_IF_ERROR(chain(HalfSum(dtype)));
  } else {
    DDLFAST_RETURN_IF_ERROR(chain(PlainWire(dtype, op, data.element_size())));
  }
  if (options.events) {
    options.events->push_back(
        {EventKind::kReduceScatter, 1, start, monotonic_seconds(), data.count() * data.element_size()});
  }
  RingSchedule gather;
  gather.phases.push_back(schedule.phases.back());
  return run_phases(data, gather, dtype, op, 1, compressed, options, RingPasses::kAllgather);
}

Status RingAllreduce::prepare_wire(const SegmentedBuffer& data, bool float32, ReduceOp op, const EngineOptions& options,
                                   int* divisor, bool* compressed) {
  *compressed = std::any_of(options.wire_by_dim.begin(), options.wire_by_dim.end(), [](int wire) { return wire >= 0; });
  if (!*compressed) return Status::ok();
  if (!float32) return Status::invalid("wire compression needs float32 data");
  if (op == ReduceOp::kProduct) {
    return Status::invalid(
        "op='product' cannot run on a compressed wire (each hop would round a product); use "
        "compression='none'");
  }
  if (options.wire_by_dim.size() != static_cast<std::size_t>(ring_.torus.num_dims())) {
    return Status::invalid("compression is given for " + std::to_string(options.wire_by_dim.size()) +
                           " dimensions but the ring has " + std::to_string(ring_.torus.num_dims()));
  }
  if (*divisor != 1) {
    // Average pre-scales, so partial sums stay within the inputs' range and
    // cannot overflow fp16 where the inputs did not.
    prescale(data, 1.0f / static_cast<float>(*divisor));
    *divisor = 1;
  }
  return Status::ok();
}

// Every phase runs the one loop (engine/ring_phases.h): the host step policy with the plain wire, or with fp16/bf16
// on the wire where options compress that phase's dimension.
Status RingAllreduce::run_phases(const SegmentedBuffer& data, const RingSchedule& schedule, DType dtype, ReduceOp op,
                                 int divisor, bool compressed, const EngineOptions& options, RingPasses halves,
                                 const SegmentedBuffer* source) {
  const std::size_t chunk_elems = std::max<std::size_t>(1, options.chunk_bytes / data.element_size());
  const int slots = std::max(2, options.receives_in_flight);
  return run_ring_schedule(
      data, schedule, halves, divisor, chunk_elems, options.events,
      [&](const RingPhase& phase, const PhaseChunks& chunks, int tag_base, int final_divisor) {
        const int wire = compressed ? options.wire_by_dim[phase.dim] : -1;
        if (phase.direct) {
          const DirectChunks direct = direct_chunks(data, phase, chunk_elems);
          if (wire >= 0) {
            DirectHostSteps<HalfWire> steps(data, phase, direct, slots, chunk_elems,
                                            HalfWire(wire, op, &scratch_.decoded, &overflows_), &scratch_,
                                            options.reproducible);
            return run_direct_phase(transport_, phase, direct, tag_base, final_divisor, steps);
          }
          if (sums_halves_in_float32(dtype, op)) {
            // Half sums accumulate in float32 at the owner, rounded once (the ring rounds every hop).
            DirectHostSteps<HalfSum> steps(data, phase, direct, slots, chunk_elems, HalfSum(dtype), &scratch_,
                                           options.reproducible);
            return run_direct_phase(transport_, phase, direct, tag_base, final_divisor, steps);
          }
          DirectHostSteps<PlainWire> steps(data, phase, direct, slots, chunk_elems,
                                           PlainWire(dtype, op, data.element_size()), &scratch_, options.reproducible);
          return run_direct_phase(transport_, phase, direct, tag_base, final_divisor, steps);
        }
        if (wire >= 0) {
          HostSteps<HalfWire> steps(data, phase, chunks, slots, chunk_elems,
                                    HalfWire(wire, op, &scratch_.decoded, &overflows_), &scratch_);
          return run_ring_phase(transport_, phase, chunks, tag_base, final_divisor, steps);
        }
        HostSteps<PlainWire> steps(data, phase, chunks, slots, chunk_elems, PlainWire(dtype, op, data.element_size()),
                                   &scratch_, &phase == &schedule.phases.front() ? source : nullptr);
        return run_ring_phase(transport_, phase, chunks, tag_base, final_divisor, steps);
      });
}

SegmentedBuffer RingAllreduce::in_block_order(const SegmentedBuffer& rank_ordered,
                                              const std::vector<std::size_t>& counts) const {
  const std::vector<ElementRange> by_rank = consecutive(counts);
  std::vector<ElementRange> ranges;
  for (int position : positions_in_block_order(ring_.torus)) ranges.push_back(by_rank[ring_.rank_at[position]]);
  return select_ranges(rank_ordered, ranges);
}

std::vector<std::size_t> RingAllreduce::counts_by_position(const std::vector<std::size_t>& counts) const {
  std::vector<std::size_t> by_position(counts.size());
  for (std::size_t position = 0; position < counts.size(); ++position) {
    by_position[position] = counts[ring_.rank_at[position]];
  }
  return by_position;
}

Status RingAllreduce::reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                                     const std::vector<std::size_t>& counts, DType dtype, ReduceOp op,
                                     const EngineOptions& options) {
  const int world = ring_.torus.world_size();
  const int me = transport_.rank();
  DDLFAST_RETURN_IF_ERROR(check_counts(counts, world, input.count(), output.count(), me));
  if (options.chain) return reduce_scatter_by_chain(input, output, counts, dtype, op, options);
  const std::size_t esize = dtype_size(dtype);
  const std::size_t total = input.count();
  // The working copy, in rank order: this rank's block is `output` itself, the other blocks live in work_.
  // The ring cuts its messages at segment boundaries, so the working copy must be cut where every other rank
  // cuts it, whatever its memory looks like here: it takes the input's pieces (block q of each array, the same
  // sizes on every rank), also where one piece of work_ or of `output` would hold several.
  if (work_.size() < (total - counts[me]) * esize) work_.resize((total - counts[me]) * esize);
  std::vector<char*> bases;
  std::vector<char*> source_bases;  // the input's pieces, the working copy's cut
  std::vector<std::size_t> sizes;
  std::size_t start = 0, cursor = 0;
  for (int q = 0; q < world; ++q) {
    std::vector<char*> pieces;
    std::vector<std::size_t> piece_counts;
    append_runs(input, {start, counts[q]}, &pieces, &piece_counts);
    source_bases.insert(source_bases.end(), pieces.begin(), pieces.end());
    std::size_t within = 0;
    for (std::size_t n : piece_counts) {
      if (q == me) {
        if (output.contiguous_from(within) < n) {
          return Status::invalid("reduce-scatter output pieces do not follow the input's block pieces");
        }
        bases.push_back(output.address(within));
      } else {
        bases.push_back(work_.data() + (cursor + within) * esize);
      }
      sizes.push_back(n);
      within += n;
    }
    if (q != me) cursor += counts[q];
    start += counts[q];
  }
  const SegmentedBuffer working(std::move(bases), sizes, esize);
  const SegmentedBuffer source_working(std::move(source_bases), sizes, esize);
  std::vector<std::size_t> block_counts = counts_by_position(counts);
  // Out of place: the ring's first phase reads the input itself (HostSteps' source), where nothing reads or
  // rewrites the working copy before it (no exact arithmetic, no wire, no small path, no direct first phase). At
  // P=2, 16 MiB the copy of the whole input was a third of the call's time.
  const bool wire = std::any_of(options.wire_by_dim.begin(), options.wire_by_dim.end(), [](int w) { return w >= 0; });
  RingSchedule schedule;
  bool out_of_place = world > 1 && total * esize > options.small_bytes && !wire && !works_on_a_copy(dtype, op);
  if (out_of_place) {
    DDLFAST_RETURN_IF_ERROR(check_direct(options.direct_by_dim, ring_.torus.num_dims()));
    schedule = build_rank_schedule(ring_, block_counts, options.direct_by_dim);
    out_of_place = !schedule.phases.empty() && !schedule.phases.front().direct &&
                   schedule.phases.front().kind == PhaseKind::kReduceScatter;
  }
  if (!out_of_place) copy_elements(input, working);
  if (total == 0 || world == 1) return Status::ok();

  const SegmentedBuffer ordered = in_block_order(working, counts);
  DDLFAST_RETURN_IF_ERROR(exact_.before(ordered, dtype, op, world));
  std::optional<SegmentedBuffer> interleaved;
  if (exact_.buffer().count() != total) {
    // Integer average also reduces the remainders (elements total.. of the widened buffer): each position's
    // block carries its own, so the block a position ends with holds both.
    std::vector<ElementRange> ranges;
    std::size_t start = 0;
    for (int position : positions_in_block_order(ring_.torus)) {
      ranges.push_back({start, block_counts[position]});
      ranges.push_back({total + start, block_counts[position]});
      start += block_counts[position];
      block_counts[position] *= 2;
    }
    interleaved.emplace(select_ranges(exact_.buffer(), ranges));
  }
  const SegmentedBuffer& data = interleaved ? *interleaved : ordered;
  const ReduceOp kernel_op = exact_.op();  // integer and half average reduce as sums
  int divisor = kernel_op == ReduceOp::kAverage ? world : 1;
  if (data.count() * esize <= options.small_bytes) {
    DDLFAST_RETURN_IF_ERROR(reduce_scatter_small(data, block_counts, dtype, kernel_op, divisor, options));
  } else {
    DDLFAST_RETURN_IF_ERROR(check_direct(options.direct_by_dim, ring_.torus.num_dims()));
    bool compressed = false;
    DDLFAST_RETURN_IF_ERROR(prepare_wire(data, dtype == DType::kFloat32, kernel_op, options, &divisor, &compressed));
    if (!out_of_place) schedule = build_rank_schedule(ring_, block_counts, options.direct_by_dim);
    const SegmentedBuffer source = in_block_order(source_working, counts);
    DDLFAST_RETURN_IF_ERROR(run_phases(data, schedule, dtype, kernel_op, divisor, compressed, options,
                                       RingPasses::kReduceScatter, out_of_place ? &source : nullptr));
  }
  if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
    return finish_fp16_bf16_reduce_scatter(input, output, counts, dtype, op);
  }
  return exact_.after(transport_);
}

// reproducible=True across hosts, uncompressed: the canonical chain's allreduce of the whole input (its bits are
// the flat order's, reduce-scatter's too: the wire is the one case where they differ, as the reduce-scatter keeps
// the float32 sum, and it takes the flat order), then this rank's block. The host link carries the ring's bytes
// each way where the flat direct reduce-scatter sends P/4 times them (2 hosts); the allgather within the hosts
// is the extra work.
Status RingAllreduce::reduce_scatter_by_chain(const SegmentedBuffer& input, const SegmentedBuffer& output,
                                              const std::vector<std::size_t>& counts, DType dtype, ReduceOp op,
                                              const EngineOptions& options) {
  if (std::any_of(options.wire_by_dim.begin(), options.wire_by_dim.end(), [](int wire) { return wire >= 0; })) {
    return Status::invalid(
        "the canonical chain's reduce-scatter runs uncompressed; a 16-bit wire takes the flat order");
  }
  const std::size_t esize = dtype_size(dtype);
  const std::size_t total = input.count();
  if (whole_.size() < total * esize + 1) whole_.resize(total * esize + 1);
  const SegmentedBuffer whole = contiguous(whole_.data(), total, esize);
  copy_elements(input, whole);
  DDLFAST_RETURN_IF_ERROR(run(whole, dtype, op, options));
  std::size_t start = 0;
  for (int q = 0; q < transport_.rank(); ++q) start += counts[q];
  copy_elements(select_ranges(whole, {{start, counts[transport_.rank()]}}), output);
  return Status::ok();
}

// Tiny buffers: MPI_Reduce_scatter, on the blocks put back in rank order.
Status RingAllreduce::reduce_scatter_small(const SegmentedBuffer& data, const std::vector<std::size_t>& block_counts,
                                           DType dtype, ReduceOp op, int divisor, const EngineOptions& options) {
  const double start = monotonic_seconds();
  const int world = ring_.torus.world_size();
  const std::size_t esize = dtype_size(dtype);
  std::vector<ElementRange> by_position(world);
  std::size_t cursor = 0;
  for (int position : positions_in_block_order(ring_.torus)) {
    by_position[position] = {cursor, block_counts[position]};
    cursor += block_counts[position];
  }
  std::vector<ElementRange> by_rank(world);
  std::vector<std::size_t> rank_counts(world);
  for (int position = 0; position < world; ++position) {
    by_rank[ring_.rank_at[position]] = by_position[position];
    rank_counts[ring_.rank_at[position]] = block_counts[position];
  }
  std::vector<char> send(data.count() * esize + 1);
  copy_elements(select_ranges(data, by_rank), contiguous(send.data(), data.count(), esize));
  const SegmentedBuffer own = select_ranges(data, {by_position[ring_.position]});
  std::vector<char> mine(own.count() * esize + 1);
  DDLFAST_RETURN_IF_ERROR(transport_.native_reduce_scatter(send.data(), mine.data(), rank_counts, dtype,
                                                           op == ReduceOp::kAverage ? ReduceOp::kSum : op));
  divide_in_place(dtype, mine.data(), own.count(), divisor);
  copy_elements(contiguous(mine.data(), own.count(), esize), own);
  if (options.events) {
    options.events->push_back({EventKind::kMpiAllreduce, -1, start, monotonic_seconds(), data.count() * esize});
  }
  return Status::ok();
}

Status RingAllreduce::finish_fp16_bf16_reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                                                      const std::vector<std::size_t>& counts, DType dtype,
                                                      ReduceOp op) {
  const std::uint16_t exponent = dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
  auto bits_at = [](const SegmentedBuffer& data, std::size_t element) {
    std::uint16_t bits;
    std::memcpy(&bits, data.address(element), sizeof bits);
    return bits;
  };
  const AnyNonFiniteFn any_nonfinite = best_kernels().any_nonfinite[dtype == DType::kFloat16 ? 0 : 1];
  std::int64_t found = 0;
  for (std::size_t done = 0; done < output.count();) {
    const std::size_t n = output.contiguous_from(done);
    if (any_nonfinite(output.address(done), n)) found = 1;
    done += n;
  }
  // Each rank holds a different block: agree before anything that communicates depends on it.
  DDLFAST_RETURN_IF_ERROR(transport_.native_allreduce(&found, 1, DType::kInt64));
  if (found == 0) return Status::ok();  // the common case
  // Rare: tell inf/nan that came in (kept, as IEEE says) from overflow, per element of each rank's block.
  std::vector<std::int32_t> inputs(input.count() + 1, 0);
  for (std::size_t i = 0; i < input.count(); ++i) inputs[i] = (bits_at(input, i) & exponent) == exponent;
  std::vector<std::int32_t> came_in(output.count() + 1, 0);
  DDLFAST_RETURN_IF_ERROR(transport_.native_reduce_scatter(inputs.data(), came_in.data(), counts, DType::kInt32));
  std::int64_t overflowed = 0;
  for (std::size_t i = 0; i < output.count(); ++i) {
    const std::uint16_t bits = bits_at(output, i);
    if ((bits & exponent) != exponent || came_in[i] != 0) continue;
    if (op != ReduceOp::kAverage) {
      ++overflowed;
    } else if ((bits & 0x7fff) == exponent) {  // average: only the rounding of the scaled terms passed the range
      const std::uint16_t saturated = static_cast<std::uint16_t>((bits & 0x8000) | (exponent - 1));
      std::memcpy(output.address(i), &saturated, sizeof saturated);
    }
  }
  if (op == ReduceOp::kAverage) return Status::ok();
  DDLFAST_RETURN_IF_ERROR(transport_.native_allreduce(&overflowed, 1, DType::kInt64));
  if (overflowed == 0) return Status::ok();
  return Status::consistent(std::string(dtype_name(dtype)) + " reduce-scatter " + reduce_op_name(op) + " overflowed: " +
                            std::to_string(overflowed) + " elements went past the largest " + dtype_name(dtype) +
                            " in a partial sum of finite inputs, and the result holds inf or nan there; use "
                            "op='average' (which pre-scales by 1/world size) or reduce in float32");
}

Status RingAllreduce::allgather(const SegmentedBuffer& input, const SegmentedBuffer& output,
                                const std::vector<std::size_t>& counts, bool float32, const EngineOptions& options) {
  const int world = ring_.torus.world_size();
  const int me = transport_.rank();
  DDLFAST_RETURN_IF_ERROR(check_counts(counts, world, output.count(), input.count(), me));
  const std::size_t esize = output.element_size();
  if (world > 1 && output.count() * esize <= options.small_bytes) {  // latency-bound: MPI_Allgather
    const double start = monotonic_seconds();
    std::vector<char> send(input.count() * esize + 1);
    copy_elements(input, contiguous(send.data(), input.count(), esize));
    std::vector<char> all(output.count() * esize + 1);
    std::vector<std::size_t> bytes;
    for (std::size_t count : counts) bytes.push_back(count * esize);
    DDLFAST_RETURN_IF_ERROR(transport_.native_allgather(send.data(), all.data(), bytes));
    copy_elements(contiguous(all.data(), output.count(), esize), output);
    if (options.events) {
      options.events->push_back({EventKind::kMpiAllreduce, -1, start, monotonic_seconds(), output.count() * esize});
    }
    return Status::ok();
  }
  const SegmentedBuffer own = select_ranges(output, {consecutive(counts)[me]});
  // A broadcast's root passes its block where the output holds it already (ddlfast/engine/small.py).
  if (input.count() > 0 && input.address(0) != own.address(0)) copy_elements(input, own);
  if (world == 1 || output.count() == 0) return Status::ok();
  const SegmentedBuffer ordered = in_block_order(output, counts);
  int divisor = 1;
  bool compressed = false;
  DDLFAST_RETURN_IF_ERROR(
      prepare_wire(ordered, float32 && esize == sizeof(float), ReduceOp::kSum, options, &divisor, &compressed));
  // One hop pipelines nothing: each block goes as one message, up to 1 GiB (2 cores, a 16 MiB broadcast at P=2:
  // 0.94x MPI_Bcast's busbw, against 0.89-0.91 in 1 MiB chunks). Allgather chunks land in place: no scratch.
  EngineOptions hop = options;
  if (world == 2) {
    constexpr std::size_t kLargestMessage = std::size_t{1} << 30;
    const std::size_t largest = *std::max_element(counts.begin(), counts.end()) * esize;
    hop.chunk_bytes = std::max(options.chunk_bytes, std::min(largest, kLargestMessage));
  }
  return run_phases(ordered, build_rank_schedule(ring_, counts_by_position(counts)), DType::kFloat32, ReduceOp::kSum, 1,
                    compressed, hop, RingPasses::kAllgather);
}

}  // namespace ddlfast
