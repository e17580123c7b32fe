// The simulation driver: ddlfast's C++ engine (src/) under SimGrid's SMPI, so
// the real ring schedules, agreement and census run at 16 to 1024 simulated
// ranks on a described platform. Built with smpicxx by ddlfast/simulate.py
// (bench/simulation/build.sh); one SMPI rank is one single-threaded actor, so
// there is no Python here.
//
//   smpirun ... driver --collective allreduce|reduce_scatter|allgather|builtin|agree
//                      --case BYTES:DIMS[:DIRECT|:latency] [--case ...] [--iters N] [--warmup N] [--check-bytes N]
//                      [--small-bytes N] [--chunk-bytes N] [--halving-bytes N] [--agreement-capacity N]
//                      [--missing-rank R --timeout S]
//                      [--corrupt-rank R]  (R adds 1 to its first input: the check must fail)
//
// DIRECT is one digit per dimension, 1 where that dimension's reduce-scatter is
// direct (EngineOptions::direct_by_dim, as ddlfast's auto chooses per call
// size: cost_model.choose_algorithm), e.g. 65536:8x4x4x8:0111. `latency` sends the case to the latency path
// whatever --small-bytes says (ddlfast's auto takes it size by size across hosts: Topology.latency_takes).
//
// Per case it prints one line `result <collective> <bytes> <dims>[:DIRECT] <seconds>`:
// the simulated time (MPI_Wtime, one clock for all ranks) from the last rank's
// entry to the last rank's exit, averaged over the timed iterations after
// --warmup untimed ones (default 1). `builtin` times MPI_Allreduce itself,
// whose algorithm smpirun's --cfg=smpi/allreduce:NAME chose; `agree` times the
// per-call agreement alone (part of every ddlfast call).
//
// Results are checked against the exact sum of known inputs for every size up
// to --check-bytes (wrong numbers: exit 3); larger buffers come from
// SMPI_SHARED_MALLOC (one copy shared by all ranks, contents meaningless) so
// 1024 ranks x 256 MiB fit in memory.
//
// --missing-rank R (or R-S): rank R (ranks R to S) never enters the
// collective; the others must fail with a stall census that names them, as
// "rank R" or "ranks R-S" (exit 0 when every other rank's message does, 4
// otherwise).
#include <mpi.h>
#include <smpi/smpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/core.h"

// smpi_compat.h's per-rank state (globals: SMPI gives each rank its own copy).
double ddlfast_sim_wait_start = -1.0;
bool ddlfast_sim_blocking_waits = false;
MPI_Request* ddlfast_sim_pending[kSimPendingMax];
int ddlfast_sim_pending_count = 0;
MPI_Request ddlfast_sim_unwaitable[kSimPendingMax];
int ddlfast_sim_unwaitable_next = 0;

namespace {

constexpr int kExitUsage = 2;
constexpr int kExitWrong = 3;
constexpr int kExitCensus = 4;
constexpr int kExitEngine = 5;

struct Case {
  std::size_t bytes;
  std::vector<int> dims;
  std::vector<int> direct;  // per dimension: 1 = direct reduce-scatter (empty: the ring everywhere)
  bool latency = false;     // the latency path takes it (the small-message limit raised to its size)
  std::string dims_text;
};

struct Options {
  std::string collective = "allreduce";
  std::vector<Case> cases;
  int iters = 2;
  int warmup = 1;  // untimed calls first (none needed for simulated time: nothing is created lazily)
  std::size_t check_bytes = 1 << 20;
  int missing_rank = -1;
  int missing_last = -1;          // the last missing rank (a range R-S)
  int corrupt_rank = -1;          // this rank's inputs differ from the reference's (the check's own test)
  double timeout_s = 0.0;         // the stall limit; 0 (off) unless the census is under test
  ddlfast::EngineOptions engine;  // small_bytes, chunk_bytes: ddlfast.config's defaults come from the CLI
  // The bytes each agreement message may carry: the context's (cost_model.agreement_capacity; the CLI passes it),
  // so the latency path takes the same calls.
  std::size_t agreement_capacity = 2 * 64 * 1024;
};

[[noreturn]] void usage(int rank, const std::string& message) {
  if (rank == 0) std::fprintf(stderr, "ddlfast simulation driver: %s\n", message.c_str());
  MPI_Finalize();
  std::exit(kExitUsage);
}

bool parse_dims(const std::string& text, std::vector<int>* dims) {
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, 'x')) {
    char* end = nullptr;
    const long value = std::strtol(part.c_str(), &end, 10);
    if (part.empty() || *end != '\0' || value < 1) return false;
    dims->push_back(static_cast<int>(value));
  }
  return !dims->empty();
}

Options parse(int argc, char** argv, int rank, int size) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage(rank, flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--collective") {
      options.collective = value;
    } else if (flag == "--case") {
      const auto colon = value.find(':');
      Case entry;
      entry.bytes = std::strtoull(value.substr(0, colon).c_str(), nullptr, 10);
      entry.dims_text = colon == std::string::npos ? std::to_string(size) : value.substr(colon + 1);
      const auto second = entry.dims_text.find(':');
      const std::string shape = entry.dims_text.substr(0, second);
      if (entry.bytes == 0 || !parse_dims(shape, &entry.dims)) usage(rank, "bad --case " + value);
      if (second != std::string::npos && entry.dims_text.substr(second + 1) == "latency") {
        entry.latency = true;
      } else if (second != std::string::npos) {
        const std::string direct = entry.dims_text.substr(second + 1);
        if (direct.size() != entry.dims.size() || direct.find_first_not_of("01") != std::string::npos) {
          usage(rank, "bad --case " + value + ": give one 0 (ring) or 1 (direct) per dimension");
        }
        for (char flag : direct) entry.direct.push_back(flag - '0');
      }
      long product = 1;
      for (int d : entry.dims) product *= d;
      if (product != size) usage(rank, "dims " + entry.dims_text + " do not multiply to " + std::to_string(size));
      options.cases.push_back(entry);
    } else if (flag == "--iters") {
      options.iters = std::atoi(value.c_str());
    } else if (flag == "--warmup") {
      options.warmup = std::atoi(value.c_str());
    } else if (flag == "--check-bytes") {
      options.check_bytes = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--small-bytes") {
      options.engine.small_bytes = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--halving-bytes") {
      options.engine.halving_bytes = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--agreement-capacity") {
      options.agreement_capacity = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--chunk-bytes") {
      options.engine.chunk_bytes = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--missing-rank") {
      const auto dash = value.find('-');
      options.missing_rank = std::atoi(value.substr(0, dash).c_str());
      options.missing_last = dash == std::string::npos ? options.missing_rank : std::atoi(value.c_str() + dash + 1);
      if (options.missing_rank < 0 || options.missing_last < options.missing_rank || options.missing_last >= size) {
        usage(rank, "bad --missing-rank " + value);
      }
    } else if (flag == "--corrupt-rank") {
      options.corrupt_rank = std::atoi(value.c_str());
    } else if (flag == "--timeout") {
      options.timeout_s = std::atof(value.c_str());
    } else {
      usage(rank, "unknown option " + flag);
    }
  }
  if (options.collective != "allreduce" && options.collective != "reduce_scatter" &&
      options.collective != "allgather" && options.collective != "builtin" && options.collective != "agree") {
    usage(rank, "unknown --collective " + options.collective);
  }
  if (options.cases.empty()) usage(rank, "no --case given");
  if (options.iters < 1) usage(rank, "--iters must be >= 1");
  if (options.warmup < 0) usage(rank, "--warmup must be >= 0");
  return options;
}

// A buffer of `bytes`: private memory when it is checked, else one shared copy (SMPI folds it).
class Buffer {
 public:
  Buffer(std::size_t bytes, bool shared) : bytes_(bytes), shared_(shared) {
    data_ = shared ? static_cast<float*>(SMPI_SHARED_MALLOC(bytes)) : static_cast<float*>(std::malloc(bytes));
  }
  ~Buffer() {
    if (shared_) {
      SMPI_SHARED_FREE(data_);
    } else {
      std::free(data_);
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  float* data() const { return data_; }
  std::size_t count() const { return bytes_ / sizeof(float); }
  ddlfast::SegmentedBuffer segmented() const {
    return ddlfast::SegmentedBuffer({reinterpret_cast<char*>(data_)}, {count()}, sizeof(float));
  }

 private:
  std::size_t bytes_;
  bool shared_;
  float* data_;
};

// Folded payloads. On buffers of SMPI_SHARED_MALLOC (the unchecked sizes) the contents mean nothing, yet SMPI
// still copies every message's payload into the receiver's buffer, and the engine's receive slots and the
// built-ins' temporary buffers are private memory: at 1024 ranks that is gigabytes of copies and of resident
// memory per call. For those cases a message above kCopiedBytes has only its first kHeaderCopiedBytes copied
// (the simulated time is the same: SMPI charges the network model, not the copy): an agreement message's header,
// which must arrive (one left behind would read as a disagreement), whatever payload the latency path carries
// behind it, and a meaningless prefix of anything else. The built-ins reduce with an operation that does nothing,
// so their temporary buffers are never touched. Smaller messages (the driver's own MPI_Allreduce of times among
// them) are copied whole. Checked cases copy everything and reduce for real.
constexpr std::size_t kCopiedBytes = 2 * 64 * 1024 + 64;
constexpr std::size_t kHeaderCopiedBytes = 64;  // the agreement's header is 48 bytes

void copy_payload(smx_activity_t comm, void* buffer, std::size_t bytes) {
  smpi_comm_copy_buffer_callback(reinterpret_cast<simgrid::kernel::activity::CommImpl*>(comm), buffer, bytes);
}

void copy_small_payloads(smx_activity_t comm, void* buffer, std::size_t bytes) {
  copy_payload(comm, buffer, bytes <= kCopiedBytes ? bytes : kHeaderCopiedBytes);
}

void no_reduction(void*, void*, int*, MPI_Datatype*) {}

// Rank r's input element i: small integers, so every partial sum is exact in float32 at 1024 ranks.
float input_value(int rank, std::size_t i) { return static_cast<float>(rank % 13 + static_cast<int>(i % 11)); }

// Sum over ranks 0..size-1 of (r % 13), in closed form: the check runs per element on every rank, and a loop over
// the ranks there made a 1 MiB check at 1024 ranks cost 10^11 additions.
long rank_term_sum(int size) {
  const long whole = size / 13;
  const long rest = size % 13;
  return whole * (12 * 13 / 2) + rest * (rest - 1) / 2;
}

float sum_value(int size, std::size_t i) {
  return static_cast<float>(rank_term_sum(size) + static_cast<long>(size) * static_cast<long>(i % 11));
}

// The first element (offset + i) whose value differs from `expected(offset + i)`, or -1.
template <typename Expected>
long first_wrong(const float* data, std::size_t count, std::size_t offset, Expected expected) {
  for (std::size_t i = 0; i < count; ++i) {
    if (data[i] != expected(offset + i)) return static_cast<long>(offset + i);
  }
  return -1;
}

struct Runner {
  ddlfast::Core* context;  // none for `builtin`: MPI_Allreduce alone
  const Options& options;
  int rank;
  int size;
  MPI_Op folded_sum;    // the built-ins' reduction on folded buffers (no_reduction)
  bool checked = true;  // the current case's buffers are private and its result is checked

  // One call of the collective on prepared buffers; false (message printed) on an engine failure.
  bool call(const Case& entry, const Buffer& input, const Buffer& output,
            const ddlfast::EngineOptions& engine_options) {
    const std::vector<int> identity;
    ddlfast::Status status;
    if (options.collective == "builtin") {
      // In place where checked; on folded buffers into the other folded buffer: SMPI's MPI_IN_PLACE copies the
      // data into a private buffer of the whole message first (64 MiB per rank resident at 64 ranks).
      const int code = checked ? MPI_Allreduce(MPI_IN_PLACE, input.data(), static_cast<int>(input.count()), MPI_FLOAT,
                                               MPI_SUM, MPI_COMM_WORLD)
                               : MPI_Allreduce(input.data(), output.data(), static_cast<int>(input.count()), MPI_FLOAT,
                                               folded_sum, MPI_COMM_WORLD);
      if (code != MPI_SUCCESS) status = ddlfast::Status(ddlfast::StatusCode::kMpiError, "MPI_Allreduce failed");
    } else {
      bool agreed = false;
      const std::uint64_t digest = (static_cast<std::uint64_t>(entry.bytes) << 8) ^ options.collective.size();
      const std::vector<std::size_t> counts(static_cast<std::size_t>(size), entry.bytes / sizeof(float) / size);
      if (options.collective == "allreduce") {  // as ddlfast.allreduce runs it: the agreement in the same call
        status = context->agreed_allreduce(digest, &agreed, input.segmented(), ddlfast::DType::kFloat32,
                                           ddlfast::ReduceOp::kSum, entry.dims, identity, engine_options);
      } else {
        status = context->transport().agree(digest, &agreed);
      }
      if (status.is_ok() && !agreed) status = ddlfast::Status(ddlfast::StatusCode::kInternal, "agreement failed");
      if (!status.is_ok() || options.collective == "agree" || options.collective == "allreduce") {
      } else if (options.collective == "reduce_scatter") {
        status = context->reduce_scatter(input.segmented(), output.segmented(), counts, ddlfast::DType::kFloat32,
                                         ddlfast::ReduceOp::kSum, entry.dims, identity, engine_options);
      } else {
        status = context->allgather(input.segmented(), output.segmented(), counts, true, entry.dims, identity,
                                    engine_options);
      }
    }
    if (!status.is_ok()) std::fprintf(stderr, "rank %d: %s\n", rank, status.message().c_str());
    return status.is_ok();
  }

  // Input and output sizes in bytes: allreduce in place; reduce-scatter P blocks in, one out; allgather the reverse.
  std::pair<std::size_t, std::size_t> sizes(const Case& entry) const {
    const std::size_t block = entry.bytes / sizeof(float) / size * sizeof(float);
    if (options.collective == "reduce_scatter") return {block * size, block};
    if (options.collective == "allgather") return {block, block * size};
    const std::size_t whole = entry.bytes / sizeof(float) * sizeof(float);
    return {whole, options.collective == "builtin" ? whole : sizeof(float)};
  }

  void fill(const Buffer& input) const {
    const std::size_t offset = options.collective == "allgather" ? input.count() * rank : 0;
    for (std::size_t i = 0; i < input.count(); ++i) input.data()[i] = input_value(rank, offset + i);
    if (rank == options.corrupt_rank && input.count() > 0) input.data()[0] += 1.0f;
  }

  // -1 when this rank's result is right, else the first wrong element.
  long check(const Buffer& input, const Buffer& output) const {
    const int p = size;
    if (options.collective == "allgather") {
      // Block q came from rank q, whose element j is input_value(q, j).
      const std::size_t block = output.count() / p;
      return first_wrong(output.data(), output.count(), 0,
                         [&](std::size_t i) { return input_value(static_cast<int>(i / block), i); });
    }
    if (options.collective == "reduce_scatter") {
      return first_wrong(output.data(), output.count(), output.count() * rank,
                         [&](std::size_t i) { return sum_value(p, i); });
    }
    return first_wrong(input.data(), input.count(), 0, [&](std::size_t i) { return sum_value(p, i); });
  }

  // Runs one case; returns the exit status (0: fine).
  int run(const Case& entry) {
    const auto [in_bytes, out_bytes] = sizes(entry);
    checked = entry.bytes <= options.check_bytes && options.collective != "agree";
    smpi_comm_set_copy_data_callback(checked ? copy_payload : copy_small_payloads);
    Buffer input(in_bytes, !checked);
    Buffer output(out_bytes, !checked);
    ddlfast::EngineOptions engine = options.engine;
    engine.direct_by_dim = entry.direct;
    if (entry.latency) engine.small_bytes = std::max(engine.small_bytes, entry.bytes);
    double total = 0.0;
    for (int iteration = 1 - options.warmup; iteration <= options.iters; ++iteration) {
      if (checked) fill(input);
      // Every call starts from the same simulator state, whatever ran before (smpi_compat.h's wait state).
      ddlfast_sim_wait_start = -1.0;
      ddlfast_sim_pending_count = 0;
      MPI_Barrier(MPI_COMM_WORLD);
      // A barrier releases ranks up to a few message latencies apart (the last ones out wait for its last
      // messages), so each rank's own elapsed time would add that skew to the call. MPI_Wtime is one simulated
      // clock for every rank: the call is timed from the last rank's entry to the last rank's exit.
      double times[2] = {MPI_Wtime(), 0.0};  // this rank's entry, exit
      if (!call(entry, input, output, engine)) return kExitEngine;
      times[1] = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, times, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (iteration > 0) total += times[1] - times[0];  // iterations <= 0: warm-up
      if (checked) {
        long wrong = check(input, output);
        if (wrong >= 0) {
          std::fprintf(stderr, "rank %d: WRONG %s result at %zu bytes dims %s: element %ld\n", rank,
                       options.collective.c_str(), entry.bytes, entry.dims_text.c_str(), wrong);
        }
        MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
        if (wrong >= 0) return kExitWrong;
      }
    }
    if (rank == 0) {
      std::printf("result %s %zu %s %.9e %s\n", options.collective.c_str(), entry.bytes, entry.dims_text.c_str(),
                  total / options.iters, checked ? "checked" : "unchecked");
      std::fflush(stdout);
    }
    return 0;
  }

  // The missing ranks sit in a barrier; every other rank must fail in the allreduce naming them.
  int missing_ranks(const Case& entry) {
    const int first = options.missing_rank;
    const int last = options.missing_last;
    const bool missing = rank >= first && rank <= last;
    const std::string who =
        first == last ? "rank " + std::to_string(first)
                      : "ranks " + std::to_string(first) + (last > first + 1 ? "-" : ",") + std::to_string(last);
    Buffer data(entry.bytes, false);
    fill(data);
    int named = 1;
    if (!missing) {
      const std::vector<int> identity;
      const ddlfast::Status status = context->allreduce(data.segmented(), ddlfast::DType::kFloat32,
                                                        ddlfast::ReduceOp::kSum, entry.dims, identity, options.engine);
      named = !status.is_ok() && status.message().find(who + " did not join") != std::string::npos;
      if (!named || rank == (first == 0 ? last + 1 : 0)) {
        std::fprintf(stderr, "rank %d: %s\n", rank, status.is_ok() ? "no error" : status.message().c_str());
      }
    }
    int every = named;
    MPI_Allreduce(MPI_IN_PLACE, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == 0) {
      std::printf("census %d ranks, missing %s: %s\n", size, who.c_str(),
                  every ? "named by every other rank" : "NOT named by every rank");
    }
    return every ? 0 : kExitCensus;
  }
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const Options options = parse(argc, argv, rank, size);
  // Without a stall limit a wait may block until one of its requests completes (smpi_compat.h); with one (the
  // census runs) it polls, so that it can give up.
  ddlfast_sim_blocking_waits = options.timeout_s <= 0;
  std::unique_ptr<ddlfast::Core> context;
  if (options.collective != "builtin") {  // the built-ins' runs need no context (its creation costs at 1024 ranks)
    const ddlfast::Status created =
        // No shared memory: SMPI would run it at no simulated cost, and the simulation models messages.
        ddlfast::Core::create(MPI_COMM_WORLD, options.timeout_s, options.agreement_capacity, false, &context);
    if (!created.is_ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, created.message().c_str());
      MPI_Abort(MPI_COMM_WORLD, kExitEngine);
    }
  }
  Runner runner{context.get(), options, rank, size, MPI_OP_NULL};
  MPI_Op_create(no_reduction, 1, &runner.folded_sum);
  int status = 0;
  if (options.missing_rank >= 0) {
    status = runner.missing_ranks(options.cases.front());
  } else {
    for (const Case& entry : options.cases) {
      status = runner.run(entry);
      if (status != 0) break;
    }
  }
  context.reset();
  MPI_Op_free(&runner.folded_sum);
  MPI_Finalize();
  return status;
}
