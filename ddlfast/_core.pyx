# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Bindings over the C++ core. Python objects are unpacked to raw pointers
here; every loop that touches data runs in C++ with the GIL released."""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_CheckSignals
from cpython.ref cimport PyObject, Py_XDECREF, Py_XINCREF
from cython.operator cimport dereference as deref
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stddef cimport size_t
from libcpp cimport bool
from libcpp.map cimport map as cpp_map
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair
from libcpp.vector cimport vector
from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_Comm

from ddlfast._core cimport (
    CoreCpp, DType, EngineOptions, KernelTable, PhaseEvent, ReduceOp, SegmentedBuffer, Status, avx2_kernels,
    best_kernels, cuda_compiled, cuda_version_string, dtype_valid, element_size, mpi_library_version, pack,
    scalar_kernels, unpack,
)

import threading

from ddlfast import config
from ddlfast.errors import DdlfastError

include "_common.pxi"
include "_kernel_paths.pxi"


cdef extern from "pythread.h":
    unsigned long PyThread_get_thread_ident() nogil

cdef extern from "Python.h":
    ctypedef struct PyFrameObject:
        pass
    ctypedef struct PyCodeObject:
        pass
    PyFrameObject* PyEval_GetFrame()
    PyFrameObject* PyFrame_GetBack(PyFrameObject* frame)
    PyCodeObject* PyFrame_GetCode(PyFrameObject* frame)
    int PyFrame_GetLasti(PyFrameObject* frame)


# The caller's stack read where CPython keeps it (3.11's interpreter frames), without making a frame object per
# frame as PyEval_GetFrame/PyFrame_GetBack do (about 250 instructions each, on every latency-path call). Other
# Pythons take the public calls (CallSites.find); the two walks give the same (code, offset) pairs.
cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030B00A6 && PY_VERSION_HEX < 0x030C0000 && !defined(PYPY_VERSION) && !defined(Py_LIMITED_API)
      #ifndef Py_BUILD_CORE
        #define Py_BUILD_CORE 1
      #endif
      #include "internal/pycore_frame.h"
      #define DDLFAST_INTERPRETER_FRAMES 1
      static inline _PyInterpreterFrame* ddlfast_complete_frame(_PyInterpreterFrame* frame) {
          while (frame != NULL && _PyFrame_IsIncomplete(frame)) frame = frame->previous;
          return frame;
      }
      static inline void* ddlfast_top_frame(void) {
          return ddlfast_complete_frame(PyThreadState_GET()->cframe->current_frame);
      }
      static inline void* ddlfast_frame_back(void* frame) {
          return ddlfast_complete_frame(((_PyInterpreterFrame*)frame)->previous);
      }
      static inline void* ddlfast_frame_code(void* frame) { return ((_PyInterpreterFrame*)frame)->f_code; }
      static inline int ddlfast_frame_instruction(void* frame) {  /* as PyFrame_GetLasti */
          int last = _PyInterpreterFrame_LASTI((_PyInterpreterFrame*)frame);
          return last < 0 ? -1 : last * (int)sizeof(_Py_CODEUNIT);
      }
    #else
      #define DDLFAST_INTERPRETER_FRAMES 0
      static inline void* ddlfast_top_frame(void) { return NULL; }
      static inline void* ddlfast_frame_back(void* frame) { (void)frame; return NULL; }
      static inline void* ddlfast_frame_code(void* frame) { (void)frame; return NULL; }
      static inline int ddlfast_frame_instruction(void* frame) { (void)frame; return -1; }
    #endif
    """
    bint DDLFAST_INTERPRETER_FRAMES
    void* ddlfast_top_frame()  # borrowed, as every pointer below: the stack does not change during the walk
    void* ddlfast_frame_back(void* frame)
    void* ddlfast_frame_code(void* frame)
    int ddlfast_frame_instruction(void* frame)


cdef class CallSites:
    """The flight recorder's call sites (ddlfast/engine/flight.py), found in C so that the latency path can
    afford one per call: the first frame of the caller's stack that `classify(code)` does not call internal,
    as a small id for its (code, instruction). Codes are classified once (by address, each kept alive so its
    address stays its own); at most `limit` codes and sites are remembered, -1 past that. `submitted`, while it
    is >= 0, is the site instead (asynchronous work, recorded where it was submitted). `public_frames` walks with
    the public frame calls even where the interpreter's own frames can be read (the tests compare the two)."""

    def __cinit__(self, classify, size_t limit, bint public_frames=False):
        self.classify = classify
        self.limit = limit
        self.sites = []
        self.classified = []
        self.public_frames = public_frames or not DDLFAST_INTERPRETER_FRAMES
        self.submitted = -1
        self.last_site = -1

    def site(self) -> int:
        return self.find()

    @property
    def reads_interpreter_frames(self) -> bool:
        return not self.public_frames

    cdef int64_t find(self) except -2:
        """The caller's site id; -1 for none."""
        cdef void* frame
        cdef PyFrameObject* public
        cdef PyFrameObject* back
        cdef PyCodeObject* code
        cdef int64_t found = -2  # -2: only internal frames so far
        cdef size_t depth = 0
        cdef uintptr_t code_key
        cdef int instruction
        if self.submitted >= 0:
            return self.submitted
        if not self.public_frames:
            # A loop calls from one line through the same ddlfast frames: those compare with the last walk's
            # (a pointer each), and the site with the last site, before any table is looked at.
            frame = ddlfast_top_frame()
            while frame != NULL:
                code_key = <uintptr_t>ddlfast_frame_code(frame)
                if depth < self.last_internal.size() and self.last_internal[depth] == code_key:
                    depth += 1
                    frame = ddlfast_frame_back(frame)
                    continue
                instruction = ddlfast_frame_instruction(frame)
                if code_key == self.last_code and instruction == self.last_instruction and self.last_site >= 0:
                    self.last_internal.resize(depth)
                    return self.last_site
                found = self._at(<void*>code_key, instruction)
                if found != -2:
                    self.last_internal.resize(depth)
                    self.last_code, self.last_instruction, self.last_site = code_key, instruction, found
                    return found
                self.last_internal.resize(depth)
                self.last_internal.push_back(code_key)
                depth += 1
                frame = ddlfast_frame_back(frame)
            return -1
        public = PyEval_GetFrame()
        Py_XINCREF(<PyObject*>public)
        while public != NULL and found == -2:
            code = PyFrame_GetCode(public)
            try:
                found = self._at(<void*>code, PyFrame_GetLasti(public))
            finally:
                Py_XDECREF(<PyObject*>code)
            back = PyFrame_GetBack(public)
            Py_XDECREF(<PyObject*>public)
            public = back
        Py_XDECREF(<PyObject*>public)
        return -1 if found == -2 else found

    cdef int64_t _at(self, void* code, int instruction) except -3:
        """-2 (go on) for an internal frame's code; else the site id of (code, instruction), -1 past the limit
        (as when a code cannot be classified any more)."""
        cdef uintptr_t key = <uintptr_t>code
        cdef bool inside
        cdef pair[uintptr_t, int] where
        cdef unordered_map[uintptr_t, bool].iterator entry = self.internal.find(key)
        cdef cpp_map[pair[uintptr_t, int], int64_t].iterator known
        cdef int64_t found
        if entry != self.internal.end():
            inside = deref(entry).second
        elif self.internal.size() >= self.limit:
            return -1
        else:
            try:
                inside = True if self.classify(<object>code) else False
            except Exception:  # noqa: BLE001 - a site is a label: never a reason for one rank to fail its call
                inside = False
            self.classified.append(<object>code)
            self.internal[key] = inside
        if inside:
            return -2
        where = pair[uintptr_t, int](key, instruction)
        known = self.ids.find(where)
        if known != self.ids.end():
            return deref(known).second
        if <size_t>len(self.sites) >= self.limit:
            return -1
        found = len(self.sites)
        self.ids[where] = found
        self.sites.append((<object>code, instruction))
        return found

    def of(self, int64_t site):
        """(code, instruction offset) of a site id, or None."""
        return self.sites[site] if 0 <= site < len(self.sites) else None

def mix_name(uint64_t name) -> int:
    """engine/agreement.name_digest of an int name (a training step) in 0..2**64-1: splitmix64's finalizer, here
    because Python's arbitrary-size ints made it a quarter of a named 4 KiB allreduce's time in Python."""
    cdef uint64_t z = name * <uint64_t>0x9E3779B97F4A7C15ULL + <uint64_t>0x5851F42D4C957F2DULL
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    return z ^ (z >> 27)


def same_values(dict environ, tuple keys, tuple values) -> bool:
    """Whether environ[keys[i]] is values[i] (the very object; None where absent) for every i: config's test,
    on every collective, that no DDLFAST_* variable changed (config.use_value_compare)."""
    cdef Py_ssize_t i
    cdef PyObject* found
    if len(keys) != len(values):
        return False
    for i in range(len(keys)):
        found = PyDict_GetItem(environ, keys[i])
        if found != <PyObject*>values[i] and not (found == NULL and values[i] is None):
            return False
    return True


config.use_value_compare(same_values)

# Python runs signal handlers on the main thread only; a wait on any other thread never asks.
cdef unsigned long _main_thread = threading.main_thread().ident
# Signal handlers that raised after a core call had completed (main thread): raised once the collective is done
# (Context._locked, Core.allreduce_array), so a completed collective is never abandoned for them.
deferred_interrupts = []


cdef bool check_signals() noexcept nogil:
    """The transport's interrupt check (MpiTransport::set_interrupt_check), every few ms of a long wait: runs
    Python's pending signal handlers; True when one raised (KeyboardInterrupt), kept for raise_on_error."""
    if PyThread_get_thread_ident() != _main_thread:
        return False
    with gil:
        try:
            PyErr_CheckSignals()
        except BaseException as error:  # noqa - whatever the handler raised reaches the caller as it is
            _raised_in_wait.append(error)
            return True
    return False


cdef int finish_call(const Status& status) except -1:
    """After a call into the core returned: its failure raised, or a signal that arrived as it completed kept
    for the end of the collective (the collective stands)."""
    raise_on_error(status)
    try:
        PyErr_CheckSignals()
    except BaseException as error:
        deferred_interrupts.append(error)
    return 0


cdef bint finish_agreed(const Status& status, bint agreed) except -1:
    """finish_call for a call that ran the per-call agreement: a signal is kept only where the ranks agreed and the
    collective ran (it stands); returns `agreed`."""
    raise_on_error(status)
    if agreed:
        finish_call(status)
    return agreed


# Whether the core was compiled with MPI's fault-tolerance extension (ULFM: Open MPI 5's mpi-ext.h).
ulfm_built = DDLFAST_HAVE_ULFM != 0


def kernel_paths():
    """Names of the CPU kernel variants this build and CPU can run, best first."""
    return available_kernel_paths()


def selected_kernel_path():
    return best_kernels().name.decode()


def reduce_into(uintptr_t dst, uintptr_t src, size_t count, int dtype, int divisor=1, path=None):
    """dst = (dst + src) / divisor over raw buffers: the kernels' test entry, and what probe.py times."""
    cdef const KernelTable* table = kernel_table(path)
    dtype_size(dtype)
    check_divisor(divisor)
    with nogil:
        table.reduce[dtype](<void*>dst, <const void*>src, count, divisor)


def pack_arrays(uintptr_t bucket, list pointers, list nbytes):
    """Copy many buffers back to back into `bucket` (one call per bucket)."""
    cdef vector[const void*] sources
    cdef vector[size_t] sizes
    if len(pointers) != len(nbytes):
        raise DdlfastError(f"{len(pointers)} pointers but {len(nbytes)} sizes")
    for pointer, size in zip(pointers, nbytes):
        sources.push_back(<const void*><uintptr_t>pointer)
        sizes.push_back(<size_t>size)
    with nogil:
        pack(<void*>bucket, sources.data(), sizes.data(), sizes.size())


def unpack_arrays(uintptr_t bucket, list pointers, list nbytes):
    """Copy a bucket's contents back out to many buffers."""
    cdef vector[void*] targets
    cdef vector[size_t] sizes
    if len(pointers) != len(nbytes):
        raise DdlfastError(f"{len(pointers)} pointers but {len(nbytes)} sizes")
    for pointer, size in zip(pointers, nbytes):
        targets.push_back(<void*><uintptr_t>pointer)
        sizes.push_back(<size_t>size)
    with nogil:
        unpack(<const void*>bucket, targets.data(), sizes.data(), sizes.size())


def build_facts():
    return {
        "cuda": True if cuda_compiled() else False,
        "cuda_version": cuda_version_string().decode(),
        "mpi_library": mpi_library_version().decode(),
        "kernel_paths": kernel_paths(),
        "kernel_selected": selected_kernel_path(),
    }


cdef class CallOptions:
    """The engine settings of one kind of call, crossing into the core as one object (EngineOptions in C++, with
    the ring's dims and rank order): built once per kind of call by the engine layer and reused
    (ddlfast/engine/state.py, EngineState.call_options).

    dims: the ring shape; order: the communicator rank of each torus position (empty: identity); wire: per ring
    dimension, -1 float32, 0 fp16, 1 bf16 (empty: no compression); direct: per ring dimension, 1 for the direct
    reduce-scatter, 0 for the ring (empty: the ring everywhere); mpi_small_path: buffers of at most small_bytes go
    to MPI's own allreduce after the agreement instead of the latency path; chain: reproducible=True's canonical
    order host by host on dims (ranks per host, hosts) (src/engine/chain_phase.h; an uncompressed reduce_scatter
    runs its allreduce and keeps its block); halving_bytes: the latency path reduces payloads of at least this
    many bytes by recursive halving and doubling (0: never; src/transport/agreement_exchange.cc); reproducible:
    reproducible=True's canonical order, where a direct reduce-scatter on the 16-bit wire rounds the owner's own
    contribution too (otherwise it joins the sum unrounded: one wire rounding fewer).
    """

    def __cinit__(self, dims, size_t chunk_bytes, int receives_in_flight, size_t small_bytes, order=(), wire=(),
                  direct=(), bint mpi_small_path=False, bint chain=False, size_t halving_bytes=0,
                  bint reproducible=False):
        self.dims = to_dims(dims)
        self.order = to_dims(order)
        fill_options(&self.options, chunk_bytes, receives_in_flight, small_bytes, NULL, wire, direct)
        self.options.small_path = SmallPath.kMpi if mpi_small_path else SmallPath.kLatency
        self.options.chain = chain
        self.options.halving_bytes = halving_bytes
        self.options.reproducible = reproducible

    @property
    def small_bytes(self) -> int:
        return self.options.small_bytes


cdef class Core:
    """Owns the C++ Core: a private duplicate of `comm` and its engines."""

    def __cinit__(self, MPI.Comm comm not None, double timeout_s=0, size_t agreement_capacity=0):
        """agreement_capacity: the bytes of a small allreduce each agreement message may carry (the latency
        path); every rank of `comm` must pass the same."""
        check_comm(comm)
        spin_us = config.spin_us()  # rank-local; read first so that a bad value fails before any collective
        cdef bint shared_memory = config.shared_memory()
        cdef Status status
        cdef MPI_Comm handle = comm.ob_mpi
        with nogil:
            status = CoreCpp.create(handle, timeout_s, agreement_capacity, shared_memory, &self.context)
        raise_on_error(status)
        self.context.get().transport().set_interrupt_check(check_signals)
        if spin_us is not None:  # else the transport's automatic choice
            self.context.get().transport().set_spin_us(spin_us)

    cdef CoreCpp* get(self) except NULL:
        if not self.context:
            raise DdlfastError("this ddlfast context is closed")
        return self.context.get()

    @property
    def rank(self) -> int:
        return self.get().rank()

    @property
    def size(self) -> int:
        return self.get().size()

    def set_timeout(self, double seconds):
        self.get().transport().set_timeout(seconds)

    @property
    def agreement_capacity(self) -> int:
        """The bytes each agreement message may carry now (the latency path's largest call)."""
        return self.get().transport().agreement_capacity()

    @property
    def shared_memory(self) -> bool:
        """Whether the agreement and the latency path run in memory every rank shares (all on one host;
        DDLFAST_SHARED_MEMORY), the same on every rank."""
        return self.get().transport().shared_memory()

    def grow_agreement_capacity(self, size_t capacity):
        """Raise the bytes each agreement message may carry to `capacity` (never lowers it): on every rank
        alike, between collectives (MpiTransport::grow_agreement_capacity)."""
        raise_on_error(self.get().grow_agreement_capacity(capacity))

    @property
    def spin_us(self) -> float:
        """How long a wait for a message spins before it yields (DDLFAST_SPIN_US, or the automatic choice)."""
        return self.get().transport().spin_us()

    def agree(self, uint64_t digest) -> bool:
        """The per-call agreement (MpiTransport::agree): True when every rank passed the same digest in the
        same collective. Stall-limited; raises when the context is broken."""
        cdef bool agreed = False
        cdef Status status
        cdef CoreCpp* context = self.get()
        with nogil:
            status = context.transport().agree(digest, &agreed, NULL)
        finish_call(status)
        return agreed

    @property
    def sequence(self) -> int:
        """The number of the collective in progress (of the latest agreement) on this context, as users count
        them from number_from_here() (the user's first call is #1)."""
        cdef MpiTransport* transport = &self.get().transport()
        return transport.shown(transport.sequence())

    def number_from_here(self) -> None:
        """The context's creation agreement passed: the next collective is #1 in every text and record."""
        self.get().transport().number_from_here()

    @property
    def last_wait_s(self) -> float:
        """This rank's wait in the latest agreement (its own clock): arrival to completion."""
        return self.get().transport().last_wait_us() * 1e-6

    def arrivals(self, size_t count):
        """The last `count` collectives' (sequence, rank that arrived last, least wait s, most wait s), oldest
        first: the same on every rank (transport/arrivals.h), up to the collective before the latest agreement."""
        cdef MpiTransport* transport = &self.get().transport()
        cdef vector[ArrivalRecord] records = transport.arrivals().last(count)
        return [(transport.shown(r.sequence), r.last_rank, r.least_us * 1e-6, r.most_us * 1e-6) for r in records]

    def set_straggler_warning(self, double warn_s, double noise_s) -> None:
        """Have straggler_warning() name a rank once it held the others more than warn_s over the last
        collectives (ArrivalLog::kWarnWindow), counting collectives where it held them more than noise_s."""
        self.get().transport().arrivals().set_warning(<uint64_t>(warn_s * 1e6), <uint64_t>(noise_s * 1e6))

    @property
    def straggler_warning_pending(self) -> bool:
        return self.get().transport().arrivals().warning_pending()

    def take_straggler_warning(self):
        """(rank, held seconds in the window) to warn about once, or None."""
        cdef uint64_t held_us = 0
        cdef int rank = self.get().transport().arrivals().take_warning(&held_us)
        return None if rank < 0 else (rank, held_us * 1e-6)

    def set_flight_capacity(self, size_t capacity) -> None:
        """Keep the last `capacity` collectives' flight entries (transport/flight_log.h; 0: off)."""
        self.get().transport().flight().resize(capacity)

    def use_call_sites(self, CallSites sites) -> None:
        """Where allreduce_array(site=-2) finds its caller's call site (None: nowhere, the recorder is off)."""
        self.call_sites = sites

    def set_flight_site(self, int64_t site) -> None:
        """The call-site id the next agreement's flight entry gets."""
        self.get().transport().flight().set_site(site)

    def flight_end(self, bint ok) -> None:
        """The latest collective ended here (done, or failed)."""
        self.get().transport().flight().end(ok)

    def flight_entries(self, size_t last=0):
        """The latest `last` (0: all kept) [(sequence, fingerprint, site, arrived_s, agreed_s, ended_s, wait_s,
        state)], oldest first; times on the steady clock (time.perf_counter's), 0 where not reached; state as
        FlightState."""
        cdef MpiTransport* transport = &self.get().transport()
        cdef vector[FlightEntry] entries = transport.flight().entries(last)
        return [(transport.shown(e.sequence), e.fingerprint, e.site, e.arrived_s, e.agreed_s, e.ended_s, e.wait_s,
                 e.state) for e in entries]

    def wait_requests(self, requests, what: str, waiting=None) -> None:
        """Complete mpi4py requests (any communicator) through the core's one stall-limited poll loop.
        waiting=(kind, peer, tag): a point-to-point wait (kind 1 receive, 2 send; peer -1: any rank), which a
        stall census then reports as such."""
        cdef MPI.Request request
        cdef Status status
        cdef CoreCpp* context = self.get()
        cdef bytes what_bytes = what.encode()
        cdef const char* what_text = what_bytes
        cdef int64_t kind = 0
        cdef int peer = -1
        cdef int64_t tag = 0
        if waiting is not None:
            kind, peer, tag = waiting
        for item in requests:
            request = <MPI.Request?>item
            with nogil:
                if kind == 0:
                    status = context.transport().wait_request(&request.ob_mpi, what_text, -1)
                else:
                    status = context.transport().wait_point_to_point(&request.ob_mpi, what_text, kind, peer, tag)
            finish_call(status)

    def abandon(self, reason: str, bint interrupted=False) -> None:
        """A collective failed here after it had started: refuse all later work and tell the other ranks
        (they fail at once instead of at their stall limit; `interrupted`: they say this rank was interrupted)."""
        cdef string text = reason.encode()
        cdef CoreCpp* context = self.get()
        with nogil:
            context.transport().abandon_and_tell(text, interrupted)

    def revoke(self) -> None:
        """ULFM (MPI's fault tolerance, ddlfast/ulfm.py): revoke the transport's communicators, so every rank's
        pending and later operations on them fail at once; a no-op where the MPI has no such extension."""
        cdef CoreCpp* context = self.get()
        with nogil:
            context.transport().revoke_communicators()

    @property
    def failure_known(self) -> bool:
        """ULFM: whether MPI reports a failed rank of the transport's communicators, or a survivor revoked them."""
        return self.get().transport().failure_known()

    @property
    def broken(self) -> bool:
        """Whether the context refuses work (thread-safe, cheap: the latency path asks on every call)."""
        return self.get().transport().broken()

    @property
    def broken_reason(self) -> str:
        """Why the context refuses work ('' while it is healthy)."""
        return self.get().transport().broken_reason().decode("utf-8", "replace")

    def request_stop(self) -> None:
        """Thread-safe: a wait in progress on another thread gives up within a poll."""
        if self.context:
            self.context.get().transport().request_stop()

    def allreduce(self, uintptr_t data, size_t count, int dtype, int op, CallOptions options not None) -> None:
        """In-place allreduce of a raw buffer; the caller validated everything."""
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        bases.push_back(<char*>data)
        sizes.push_back(count)
        self._run(bases, sizes, dtype, op, options)

    def allreduce_segments(self, list pointers, list counts, int dtype, int op, CallOptions options not None,
                           agreement=None) -> bool:
        """Allreduce several same-dtype buffers as one logical buffer, each in place (no packing).

        agreement: a fingerprint to run the per-call agreement on in the same call (Core::agreed_allreduce;
        uncompressed only); returns False, having written nothing, when the ranks disagree."""
        cdef unique_ptr[SegmentedBuffer] data
        to_segments(pointers, counts, dtype_size(dtype), &data)
        if agreement is not None and not options.options.wire_by_dim.empty():
            raise DdlfastError("the agreement runs inside the core call for uncompressed buffers only")
        return self._run_segments(data.get()[0], dtype, op, options, agreement is not None,
                                  0 if agreement is None else <uint64_t>agreement)

    cdef bint _run(self, const vector[char*]& bases, const vector[size_t]& sizes, int dtype, int op,
                   CallOptions options, bint agree=False, uint64_t digest=0) except -1:
        cdef unique_ptr[SegmentedBuffer] data
        data.reset(new SegmentedBuffer(bases, sizes, dtype_size(dtype)))
        return self._run_segments(data.get()[0], dtype, op, options, agree, digest)

    cdef bint _run_segments(self, const SegmentedBuffer& data, int dtype, int op, CallOptions options,
                            bint agree, uint64_t digest) except -1:
        """The allreduce; with `agree`, the per-call agreement on `digest` in the same call
        (Core::agreed_allreduce): False when the ranks disagree, having written nothing."""
        check_op(op)
        cdef EngineOptions engine_options = self._with_events(options)
        cdef Status status
        cdef bool agreed = True
        cdef CoreCpp* context = self.get()
        with nogil:
            if agree:
                status = context.agreed_allreduce(digest, &agreed, data, <DType>dtype, <ReduceOp>op, options.dims,
                                                  options.order, engine_options)
            else:
                status = context.allreduce(data, <DType>dtype, <ReduceOp>op, options.dims, options.order,
                                           engine_options)
        return finish_agreed(status, agreed)

    cdef EngineOptions _with_events(self, CallOptions options):
        """The call's options, recording phases into this engine's events when asked to."""
        cdef EngineOptions engine_options = options.options
        engine_options.events = &self.events if self.record_events else NULL
        return engine_options

    def reduce_scatter_segments(self, list in_pointers, list in_counts, list out_pointers, list out_counts,
                                counts, int dtype, int op, CallOptions options not None, agreement=None,
                                bint carried=False) -> bool:
        """Reduce-scatter (RingAllreduce::reduce_scatter): the input segments hold every rank's block in rank
        order (counts[q] elements for rank q) and stay unchanged; this rank's block lands in the output
        segments. The caller validated everything.

        agreement: a fingerprint to run the per-call agreement on in the same call (Core::agreed_reduce_scatter,
        uncompressed; `carried`: inside the agreement's messages); returns False, having written nothing, when
        the ranks disagree."""
        cdef size_t element_size = dtype_size(dtype)
        check_op(op)
        return self._shard(True, in_pointers, in_counts, out_pointers, out_counts, counts, element_size, dtype, op,
                           options, agreement is not None, 0 if agreement is None else <uint64_t>agreement, carried)

    def allgather_segments(self, list in_pointers, list in_counts, list out_pointers, list out_counts, counts,
                           size_t element_size, bint float32, CallOptions options not None, agreement=None,
                           bint carried=False) -> bool:
        """Allgather (RingAllreduce::allgather) of elements of element_size bytes: this rank's block from the
        input segments, every rank's block (counts[q] elements) in rank order into the output segments.
        The options' wire compresses only float32 elements. agreement, carried: as reduce_scatter_segments'
        (opaque elements only)."""
        if element_size == 0:
            raise DdlfastError("element_size must be at least 1")
        if agreement is not None and float32:
            raise DdlfastError("the agreement runs inside the core call for opaque elements only")
        return self._shard(False, in_pointers, in_counts, out_pointers, out_counts, counts, element_size,
                           0 if float32 else -1, 0, options, agreement is not None,
                           0 if agreement is None else <uint64_t>agreement, carried)

    cdef bint _shard(self, bint reduce, list in_pointers, list in_counts, list out_pointers, list out_counts, counts,
                     size_t element_size, int dtype, int op, CallOptions options, bint agree=False,
                     uint64_t digest=0, bint carried=False) except -1:
        """dtype: allgather passes 0 for float32 (the wire may compress it), -1 for opaque elements. With `agree`:
        False when the ranks disagree, having written nothing."""
        cdef unique_ptr[SegmentedBuffer] source
        cdef unique_ptr[SegmentedBuffer] target
        to_segments(in_pointers, in_counts, element_size, &source)
        to_segments(out_pointers, out_counts, element_size, &target)
        cdef vector[size_t] blocks = to_sizes(counts)
        if agree:
            return self._agreed_shard(reduce, source.get()[0], target.get()[0], blocks, dtype, op, options, digest,
                                      carried)
        cdef EngineOptions engine_options = self._with_events(options)
        cdef Status status
        cdef CoreCpp* context = self.get()
        with nogil:
            if reduce:
                status = context.reduce_scatter(source.get()[0], target.get()[0], blocks, <DType>dtype,
                                                <ReduceOp>op, options.dims, options.order, engine_options)
            else:
                status = context.allgather(source.get()[0], target.get()[0], blocks, dtype == 0, options.dims,
                                           options.order, engine_options)
        finish_call(status)
        return True

    cdef bint _agreed_shard(self, bint reduce, const SegmentedBuffer& source, const SegmentedBuffer& target,
                            const vector[size_t]& blocks, int dtype, int op, CallOptions options, uint64_t digest,
                            bint carried) except -1:
        """Core::agreed_reduce_scatter / agreed_allgather: False when the ranks disagree, having written nothing."""
        cdef EngineOptions engine_options = self._with_events(options)
        cdef Status status
        cdef bool agreed = True
        cdef CoreCpp* context = self.get()
        with nogil:
            if reduce:
                status = context.agreed_reduce_scatter(digest, carried, &agreed, source, target, blocks, <DType>dtype,
                                                       <ReduceOp>op, options.dims, options.order, engine_options)
            else:
                status = context.agreed_allgather(digest, carried, &agreed, source, target, blocks, options.dims,
                                                  options.order, engine_options)
        return finish_agreed(status, agreed)

    def shard_array(self, bint reduce, array, out, size_t count, int dtype, int op, CallOptions options not None,
                    uint64_t digest, bint carried, int64_t site=-1):
        """reduce_scatter() or allgather() of one array into `out`, with the per-call agreement on `digest` in
        the same call (Core::agreed_reduce_scatter / agreed_allgather; `carried`: inside the agreement's
        messages). reduce: `count` elements of dtype `dtype`, equal blocks, this rank's into `out`; else `count`
        bytes (opaque) from every rank, in rank order into `out`.

        Returns 1 when done; 0, having written nothing, when the ranks disagree; -1, having done nothing (not even
        the agreement), where a buffer does not fit: `array` not a C-contiguous buffer of `count` aligned
        elements, `out` not a writable C-contiguous one of the result's size, or the two overlapping. The caller
        then takes the general path, which says what is wrong on every rank. `site`: as allreduce_array's."""
        cdef Py_buffer source_view
        cdef Py_buffer target_view
        cdef CoreCpp* context = self.get()
        cdef int world = context.size()
        cdef size_t element_size
        cdef size_t result
        cdef uintptr_t source_start
        cdef uintptr_t target_start
        cdef vector[size_t] blocks
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        cdef bint agreed
        cdef unique_ptr[SegmentedBuffer] source
        cdef unique_ptr[SegmentedBuffer] target
        try:
            PyObject_GetBuffer(array, &source_view, PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):
            return -1
        try:
            try:
                PyObject_GetBuffer(out, &target_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
            except (BufferError, ValueError):  # read-only or not C-contiguous
                return -1
            try:
                element_size = <size_t>source_view.itemsize if reduce else 1
                result = count // <size_t>world if reduce else count * <size_t>world
                source_start = <uintptr_t>source_view.buf
                target_start = <uintptr_t>target_view.buf
                if (<size_t>source_view.len != count * element_size or <size_t>target_view.len != result * element_size
                        or target_view.itemsize != source_view.itemsize or count % <size_t>world and reduce
                        or source_start % element_size != 0 or target_start % element_size != 0
                        or (source_view.len and target_view.len and source_start < target_start + target_view.len
                            and target_start < source_start + source_view.len)):
                    return -1
                blocks.assign(world, result if reduce else count)
                bases.push_back(<char*>source_view.buf)
                sizes.push_back(count)
                source.reset(new SegmentedBuffer(bases, sizes, element_size))
                bases[0] = <char*>target_view.buf
                sizes[0] = result
                target.reset(new SegmentedBuffer(bases, sizes, element_size))
                self._set_site(site)
                if reduce:
                    check_op(op)
                agreed = self._agreed_shard(reduce, source.get()[0], target.get()[0], blocks, dtype, op, options,
                                            digest, carried)
            finally:
                PyBuffer_Release(&target_view)
        finally:
            PyBuffer_Release(&source_view)
        return self._outcome(agreed)

    def broadcast_array(self, array, size_t nbytes, int root, CallOptions options not None, bint carried,
                        uint64_t digest, int64_t site=-1):
        """broadcast() of one array's `nbytes` bytes from `root` with the per-call agreement on `digest`
        (Core::agreed_allgather with root's block only): `carried` in the agreement's messages, else along the
        ring once the ranks agreed. Returns as shard_array: 1 done, 0 the ranks disagreed (nothing written), -1
        nothing ran (not a writable C-contiguous buffer of nbytes)."""
        cdef Py_buffer view
        cdef CoreCpp* context = self.get()
        cdef vector[size_t] blocks
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        cdef unique_ptr[SegmentedBuffer] source
        cdef unique_ptr[SegmentedBuffer] target
        cdef bint agreed
        if root < 0 or root >= context.size():
            return -1
        try:
            PyObject_GetBuffer(array, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):  # read-only or not C-contiguous
            return -1
        try:
            if <size_t>view.len != nbytes:
                return -1
            blocks.assign(context.size(), 0)
            blocks[root] = nbytes
            if context.rank() == root:
                bases.push_back(<char*>view.buf)
                sizes.push_back(nbytes)
            source.reset(new SegmentedBuffer(bases, sizes, 1))
            bases.assign(1, <char*>view.buf)
            sizes.assign(1, nbytes)
            target.reset(new SegmentedBuffer(bases, sizes, 1))
            self._set_site(site)
            agreed = self._agreed_shard(False, source.get()[0], target.get()[0], blocks, -1, 0, options, digest,
                                        carried)
        finally:
            PyBuffer_Release(&view)
        return self._outcome(agreed)

    cdef int _set_site(self, int64_t site) except -1:
        """The flight recorder's call site for the next collective (allreduce_array's `site`)."""
        if site == -2:
            self.get().transport().flight().set_site(-1 if self.call_sites is None else self.call_sites.find())
        elif site >= 0:
            self.get().transport().flight().set_site(site)
        return 0

    cdef int _outcome(self, bint agreed) except -2:
        """An array entry's result: 1 done, 0 the ranks disagreed; a Ctrl-C kept for the collective's end now."""
        if not agreed:
            return 0
        if deferred_interrupts:  # the collective completed: it stands (ddlfast/engine/fast_path.py)
            raise deferred_interrupts.pop()
        return 1

    def allreduce_array(self, array, size_t count, int dtype, int op, CallOptions options not None,
                        uint64_t digest, int64_t site=-1):
        """allreduce() for one array, with the per-call agreement on `digest` in the same call (one crossing
        into the core, Core::agreed_allreduce): a buffer of at most the options' small_bytes rides in the
        agreement's own messages (the latency path).

        Returns 1 when done; 0, having written nothing, when the ranks disagree; -1, having done nothing (not
        even the agreement), when the array does not export a writable C-contiguous buffer of whole aligned
        elements: the caller then takes the general path, which says what is wrong on every rank. `site`: the
        flight recorder's id of the caller's call site; -1: the one set before (set_flight_site) stands; -2: the
        caller's, found here where the flight recorder is on (use_call_sites).
        """
        cdef Py_buffer view
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        cdef bint agreed
        try:
            PyObject_GetBuffer(array, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):  # read-only or not C-contiguous
            return -1
        try:
            if (<size_t>view.len != count * <size_t>view.itemsize
                    or (<uintptr_t>view.buf) % <uintptr_t>view.itemsize != 0):
                return -1
            bases.push_back(<char*>view.buf)
            sizes.push_back(count)
            self._set_site(site)
            agreed = self._run(bases, sizes, dtype, op, options, True, digest)
        finally:
            PyBuffer_Release(&view)
        return self._outcome(agreed)

    def take_overflows(self) -> int:
        """Finite values this rank's wire encoders turned into inf since the last call."""
        return self.get().take_overflows()

    def take_events(self):
        """Phase events recorded since the last call: [(kind, dim, start_s, end_s, bytes)]."""
        return take_events(&self.events)

    def close(self):
        self.context.reset()


cdef extern from *:
    """
    #ifndef DDLFAST_COMPILER
    #define DDLFAST_COMPILER "unknown"
    #endif
    static const char* ddlfast_compiler(void) { return DDLFAST_COMPILER; }
    """
    const char* ddlfast_compiler()


def compiler():
    return ddlfast_compiler().decode()
