# C++ declarations of the compiled core, in one place (as mpi4py's libmpi.pxd).
from libc.stddef cimport size_t
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.memory cimport unique_ptr
from libcpp.map cimport map as cpp_map
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair
from libcpp.vector cimport vector
from mpi4py.libmpi cimport MPI_Comm, MPI_Request


cdef extern from "common/status.h" namespace "ddlfast" nogil:
    cdef cppclass Status:
        bool is_ok()
        int code_int()
        const string& message()


cdef extern from "common/dtype.h" namespace "ddlfast" nogil:
    cdef enum class DType(int):
        pass
    cdef enum class ReduceOp(int):
        pass
    bint dtype_valid(int value)
    size_t element_size "ddlfast::dtype_size"(DType dtype)  # the one table of element sizes


cdef extern from "kernels/cpu/cpu_kernels.h" namespace "ddlfast" nogil:
    ctypedef void (*ReduceFn)(void* dst, const void* src, size_t n, int divisor)
    ctypedef size_t (*EncodeFn)(void* dst_wire, const float* src, size_t n)
    ctypedef void (*DecodeFn)(float* dst, const void* src_wire, size_t n)
    ctypedef void (*AccumulateFn)(float* dst, const void* src_wire, size_t n, int divisor)
    ctypedef void (*SplitFn)(void* values, void* remainders, size_t n, int divisor)
    ctypedef void (*JoinFn)(void* values, const void* remainders, size_t n, int divisor)
    ctypedef bool (*AnyNonFiniteFn)(const void* values, size_t n)
    ctypedef void (*CombineFn)(void* dst, const void* src, size_t n)
    cdef struct CombineTable:
        CombineFn fn[3][6]
    cdef struct KernelTable:
        const char* name
        ReduceFn reduce[6]
        EncodeFn encode[2]
        DecodeFn decode[2]
        AccumulateFn accumulate[2]
        SplitFn split[2]
        JoinFn join[2]
        AnyNonFiniteFn any_nonfinite[2]
        CombineTable combine
    const KernelTable& scalar_kernels()
    const KernelTable* avx2_kernels()
    const KernelTable& best_kernels()


cdef extern from "algo/torus.h" namespace "ddlfast" nogil:
    cdef cppclass Torus:
        Torus()
        @staticmethod
        Status make(const vector[int]& dims, int world_size, Torus* out) except +
        int world_size()


cdef extern from "algo/ring_schedule.h" namespace "ddlfast" nogil:
    cdef struct ElementRange:
        size_t offset
        size_t count
    cdef struct RingStep:
        ElementRange send
        ElementRange recv
    cdef enum class PhaseKind(int):
        pass
    cdef cppclass RingPhase:
        PhaseKind kind
        int dim
        int successor
        int predecessor
        vector[RingStep] steps
        bool direct
        int coordinate
        vector[int] peers
        vector[ElementRange] blocks
    cdef cppclass RingSchedule:
        vector[RingPhase] phases
        ElementRange owned
    RingSchedule build_ring_schedule(const Torus& torus, int rank, size_t count,
                                     const vector[int]& direct_by_dim) except +
    RingSchedule build_ring_schedule(const Torus& torus, int rank, const vector[size_t]& block_counts,
                                     const vector[int]& direct_by_dim) except +
    vector[int] positions_in_block_order(const Torus& torus) except +


cdef extern from "algo/butterfly.h" namespace "ddlfast" nogil:
    cdef enum class ButterflyRole(int):
        kFoldOut
        kFoldIn
        kExchange
    cdef cppclass Butterfly:
        ButterflyRole role
        int fold_partner
        vector[int] step_partners
    Butterfly butterfly(int rank, int size)


cdef extern from "engine/ring_allreduce.h" namespace "ddlfast" nogil:
    cdef enum class EventKind(int):
        kReduceScatter
        kAllgather
        kMpiAllreduce
        kLatencyAllreduce
    cdef struct PhaseEvent:
        EventKind kind
        int dim
        double start_s
        double end_s
        size_t bytes
    cdef enum class SmallPath(int):
        kLatency
        kMpi
    cdef struct EngineOptions:
        size_t chunk_bytes
        int receives_in_flight
        size_t small_bytes
        SmallPath small_path
        size_t halving_bytes
        vector[PhaseEvent]* events
        vector[int] wire_by_dim
        vector[int] direct_by_dim
        bool chain
        bool reproducible


cdef extern from "engine/segmented_buffer.h" namespace "ddlfast" nogil:
    cdef cppclass SegmentedBuffer:
        SegmentedBuffer(vector[char*] bases, const vector[size_t]& counts, size_t element_size) except +
        size_t count()


cdef extern from "engine/pack.h" namespace "ddlfast" nogil:
    void pack(void* bucket, const void* const* arrays, const size_t* nbytes, size_t count)
    void unpack(const void* bucket, void* const* arrays, const size_t* nbytes, size_t count)


cdef extern from "transport/transport.h" namespace "ddlfast" nogil:
    cdef struct AgreedReduction:
        void* data
        size_t count
        DType dtype
        ReduceOp op


cdef extern from "transport/arrivals.h" namespace "ddlfast" nogil:
    cdef cppclass ArrivalRecord:
        uint64_t sequence
        int last_rank
        uint64_t least_us
        uint64_t most_us
    cdef cppclass ArrivalLog:
        vector[ArrivalRecord] last(size_t count) except +
        void set_warning(uint64_t warn_us, uint64_t noise_us) except +
        int take_warning(uint64_t* held_us)
        bool warning_pending()

cdef extern from "transport/flight_log.h" namespace "ddlfast" nogil:
    cdef cppclass FlightEntry:
        uint64_t sequence
        uint64_t fingerprint
        int64_t site
        double arrived_s
        double agreed_s
        double ended_s
        double wait_s
        int state
    cdef cppclass FlightLog:
        void resize(size_t capacity) except +
        size_t capacity()
        void set_site(int64_t site)
        void end(bool ok)
        vector[FlightEntry] entries(size_t last) except +

cdef extern from "transport/mpi_transport.h" namespace "ddlfast" nogil:
    string mpi_library_version()
    ctypedef bool (*InterruptCheck)() noexcept nogil
    cdef cppclass MpiTransport:
        void set_interrupt_check(InterruptCheck check)
        void set_timeout(double seconds)
        void set_spin_us(double microseconds)
        double spin_us()
        Status wait_request(MPI_Request* request, const char* what, int peer) except +
        Status wait_point_to_point(MPI_Request* request, const char* what, int64_t kind, int peer,
                                   int64_t tag) except +
        Status agree(uint64_t digest, bool* agreed, const AgreedReduction* reduction) except +
        size_t agreement_capacity()
        bool shared_memory()
        uint64_t sequence()
        void number_from_here()
        int64_t shown(uint64_t sequence)
        ArrivalLog& arrivals()
        FlightLog& flight()
        uint64_t last_wait_us()
        void abandon_and_tell(const string& reason, bool interrupted) except +
        void revoke_communicators() except +
        bool failure_known()
        bool broken()
        string broken_reason()
        void request_stop()


cdef extern from "transport/fault_tolerance.h" nogil:
    const int DDLFAST_HAVE_ULFM


cdef extern from "engine/core.h" namespace "ddlfast" nogil:
    cdef cppclass CoreCpp "ddlfast::Core":
        @staticmethod
        Status create(MPI_Comm comm, double timeout_s, size_t agreement_capacity, bool shared_memory,
                      unique_ptr[CoreCpp]* out) except +
        int rank()
        int size()
        MpiTransport& transport()
        Status grow_agreement_capacity(size_t capacity) except +
        size_t take_overflows()
        Status allreduce(const SegmentedBuffer& data, DType dtype, ReduceOp op, const vector[int]& dims,
                         const vector[int]& order, const EngineOptions& options) except +
        Status agreed_allreduce(uint64_t digest, bool* agreed, const SegmentedBuffer& data, DType dtype, ReduceOp op,
                                const vector[int]& dims, const vector[int]& order,
                                const EngineOptions& options) except +
        Status reduce_scatter(const SegmentedBuffer& input, const SegmentedBuffer& output,
                              const vector[size_t]& counts, DType dtype, ReduceOp op, const vector[int]& dims,
                              const vector[int]& order, const EngineOptions& options) except +
        Status allgather(const SegmentedBuffer& input, const SegmentedBuffer& output, const vector[size_t]& counts,
                         bool float32, const vector[int]& dims, const vector[int]& order,
                         const EngineOptions& options) except +
        Status agreed_reduce_scatter(uint64_t digest, bool carried, bool* agreed, const SegmentedBuffer& input,
                                     const SegmentedBuffer& output, const vector[size_t]& counts, DType dtype,
                                     ReduceOp op, const vector[int]& dims, const vector[int]& order,
                                     const EngineOptions& options) except +
        Status agreed_allgather(uint64_t digest, bool carried, bool* agreed, const SegmentedBuffer& input,
                                const SegmentedBuffer& output, const vector[size_t]& counts, const vector[int]& dims,
                                const vector[int]& order, const EngineOptions& options) except +


cdef extern from "common/cuda_info.h" namespace "ddlfast" nogil:
    bool cuda_compiled()
    string cuda_version_string()


# The engine settings of one kind of call (ddlfast/_core.pyx), declared here so that the other modules can take it.
cdef class CallOptions:
    cdef EngineOptions options
    cdef vector[int] dims
    cdef vector[int] order


# The flight recorder's call sites (ddlfast/_core.pyx), declared here so that Core can hold one.
cdef class CallSites:
    cdef unordered_map[uintptr_t, bool] internal
    cdef cpp_map[pair[uintptr_t, int], int64_t] ids
    cdef list sites
    cdef list classified
    cdef object classify
    cdef size_t limit
    cdef bint public_frames
    cdef public int64_t submitted
    cdef vector[uintptr_t] last_internal  # the codes the last walk went through, outermost last
    cdef uintptr_t last_code
    cdef int last_instruction
    cdef int64_t last_site
    cdef int64_t find(self) except -2
    cdef int64_t _at(self, void* code, int instruction) except -3


# The Python face of the C++ Core (ddlfast/_core.pyx), declared here so that the other modules can take it.
cdef class Core:
    cdef unique_ptr[CoreCpp] context
    cdef CallSites call_sites
    cdef vector[PhaseEvent] events
    cdef public bint record_events
    cdef CoreCpp* get(self) except NULL
    cdef bint _run(self, const vector[char*]& bases, const vector[size_t]& sizes, int dtype, int op,
                   CallOptions options, bint agree=*, uint64_t digest=*) except -1
    cdef bint _run_segments(self, const SegmentedBuffer& data, int dtype, int op, CallOptions options,
                            bint agree, uint64_t digest) except -1
    cdef EngineOptions _with_events(self, CallOptions options)
    cdef bint _shard(self, bint reduce, list in_pointers, list in_counts, list out_pointers, list out_counts, counts,
                     size_t element_size, int dtype, int op, CallOptions options, bint agree=*, uint64_t digest=*,
                     bint carried=*) except -1
    cdef int _set_site(self, int64_t site) except -1
    cdef int _outcome(self, bint agreed) except -2
    cdef bint _agreed_shard(self, bint reduce, const SegmentedBuffer& source, const SegmentedBuffer& target,
                            const vector[size_t]& blocks, int dtype, int op, CallOptions options, uint64_t digest,
                            bint carried) except -1
