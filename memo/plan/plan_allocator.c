/* The allocator entry points PyTorch's CUDAPluggableAllocator calls for every tensor request
 * (memo/plan/cuda_arena.py builds, loads and configures this file).
 *
 * While serving is on, a request asks the plan server (a Python callback, memo.plan.server)
 * for an arena offset; -1 means "not planned" and the request goes to the fallback allocator. A free
 * inside the arena goes back to the server; any other free to the fallback. While recording is on,
 * fallback requests and frees are also reported, so that one step's requests can be traced. The
 * fallback functions and the arena are given by the caller: cudaMallocAsync / cudaFreeAsync and one
 * cudaMalloc'd arena on a GPU, the C library's malloc / free and a host buffer in the tests.
 *
 * No CUDA or Python header is needed: streams are opaque pointers, and the four Python API
 * functions used come as pointers. Calls come from any thread (the autograd engine's included); the
 * counters are atomic, and the Python callbacks take the GIL themselves.
 */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef int64_t (*serve_fn)(size_t size);                  /* offset, or -1 */
typedef void (*release_fn)(int64_t offset);
typedef void (*record_alloc_fn)(void *ptr, size_t size);
typedef void (*record_free_fn)(void *ptr);
typedef void *(*fallback_alloc_fn)(size_t size, void *stream);
typedef void (*fallback_free_fn)(void *ptr, void *stream);

static char *arena;
static size_t arena_bytes;
static serve_fn serve;
static release_fn release;
static record_alloc_fn record_alloc;
static record_free_fn record_free;
static fallback_alloc_fn fallback_alloc;
static fallback_free_fn fallback_free;
static int serving, recording;

/* The callbacks run inside PyTorch's C++ code, sometimes while a Python exception propagates
 * through it: torch.utils.checkpoint ends a recomputation by raising from a saved-tensor hook, and
 * the tensors dropped on the way out are freed here. Python code run with an exception pending
 * turns it into a SystemError that ctypes reports as unraisable and clears, so the exception is
 * lost and the caller fails with "returned NULL without setting an exception". The pending
 * exception is set aside around every callback and put back after it. */
typedef int (*gil_ensure_fn)(void);
typedef void (*gil_release_fn)(int);
typedef void (*err_fetch_fn)(void **type, void **value, void **traceback);
typedef void (*err_restore_fn)(void *type, void *value, void *traceback);
static gil_ensure_fn gil_ensure;
static gil_release_fn gil_release;
static err_fetch_fn err_fetch;
static err_restore_fn err_restore;

typedef struct {
    int gil;
    void *type, *value, *traceback;
} pending_error;

static pending_error set_aside(void) {
    pending_error p;
    p.gil = gil_ensure();
    err_fetch(&p.type, &p.value, &p.traceback);
    return p;
}

static void put_back(pending_error p) {
    err_restore(p.type, p.value, p.traceback);
    gil_release(p.gil);
}
/* Only requests on this stream are planned: the arena knows nothing of streams, so a block freed
 * by a side stream's (or NCCL's) tensor could be handed out while that stream still uses it. */
static void *serve_stream;

/* counters[]: served requests, fallback requests, fallback frees, bytes allocated now (served and
 * fallback, as asked for), most bytes allocated at once, fallback requests refused (out of memory),
 * the size of the last one refused. */
static int64_t counters[7];

/* The callbacks, the fallback and the Python API functions (PyGILState_Ensure, PyGILState_Release,
 * PyErr_Fetch, PyErr_Restore), once; the arena comes later (memo_set_arena), so that a fallback
 * set in between (memo_use_cuda_fallback) stays. */
void memo_configure(serve_fn s, release_fn r, record_alloc_fn ra, record_free_fn rf, fallback_alloc_fn fa,
                    fallback_free_fn ff, gil_ensure_fn ge, gil_release_fn gr, err_fetch_fn ef,
                    err_restore_fn er) {
    gil_ensure = ge;
    gil_release = gr;
    err_fetch = ef;
    err_restore = er;
    serve = s;
    release = r;
    record_alloc = ra;
    record_free = rf;
    fallback_alloc = fa;
    fallback_free = ff;
}

void memo_set_serve_stream(void *stream) { serve_stream = stream; }

void memo_set_arena(void *arena_ptr, size_t arena_size) {
    arena = arena_ptr;
    arena_bytes = arena_size;
}

/* On a GPU the fallback is CUDA's stream-ordered allocator (cudaMallocAsync, whose pool caches). */
typedef int (*cuda_malloc_async_fn)(void **ptr, size_t size, void *stream);
typedef int (*cuda_free_async_fn)(void *ptr, void *stream);
typedef int (*cuda_synchronize_fn)(void);
typedef int (*cuda_pool_trim_fn)(void *pool, size_t keep);
typedef int (*cuda_get_last_error_fn)(void);
static cuda_malloc_async_fn cuda_malloc_async;
static cuda_free_async_fn cuda_free_async;
static cuda_synchronize_fn cuda_synchronize;
static cuda_pool_trim_fn cuda_pool_trim;
static cuda_get_last_error_fn cuda_get_last_error;
static void *cuda_pool;

/* Out of memory, once more after the device is idle and the pool has given back what it caches
 * (frees still in flight on other streams, blocks no stream order lets it reuse). The refusal is
 * counted, so the caller can tell an out-of-memory from another failure: PyTorch's pluggable
 * allocator passes the NULL on unchecked. */
static void *cuda_fallback_alloc(size_t size, void *stream) {
    void *ptr = NULL;
    if (cuda_malloc_async(&ptr, size, stream) == 0) return ptr;
    cuda_get_last_error(); /* clear the sticky-until-read error of the failed call */
    cuda_synchronize();
    cuda_pool_trim(cuda_pool, 0);
    ptr = NULL;
    if (cuda_malloc_async(&ptr, size, stream) == 0) return ptr;
    cuda_get_last_error();
    __atomic_add_fetch(&counters[5], 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&counters[6], (int64_t)size, __ATOMIC_SEQ_CST);
    return NULL;
}

static void cuda_fallback_free(void *ptr, void *stream) { cuda_free_async(ptr, stream); }

void memo_use_cuda_fallback(cuda_malloc_async_fn m, cuda_free_async_fn f, cuda_synchronize_fn sync,
                            cuda_pool_trim_fn trim, cuda_get_last_error_fn last_error, void *pool) {
    cuda_malloc_async = m;
    cuda_free_async = f;
    cuda_synchronize = sync;
    cuda_pool_trim = trim;
    cuda_get_last_error = last_error;
    cuda_pool = pool;
    fallback_alloc = cuda_fallback_alloc;
    fallback_free = cuda_fallback_free;
}

void memo_set_modes(int serve_on, int record_on) {
    __atomic_store_n(&serving, serve_on, __ATOMIC_SEQ_CST);
    __atomic_store_n(&recording, record_on, __ATOMIC_SEQ_CST);
}

void memo_counters(int64_t out[7]) {
    for (int i = 0; i < 7; i++) out[i] = __atomic_load_n(&counters[i], __ATOMIC_SEQ_CST);
}

void memo_reset_peak(void) {
    __atomic_store_n(&counters[4], __atomic_load_n(&counters[3], __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST);
}

static void add_allocated(int64_t bytes) {
    int64_t now = __atomic_add_fetch(&counters[3], bytes, __ATOMIC_SEQ_CST);
    int64_t peak = __atomic_load_n(&counters[4], __ATOMIC_SEQ_CST);
    while (now > peak && !__atomic_compare_exchange_n(&counters[4], &peak, now, 0, __ATOMIC_SEQ_CST,
                                                      __ATOMIC_SEQ_CST)) {
    }
}

void *memo_alloc(ssize_t size, int device, void *stream) {
    (void)device;
    if (size <= 0) return NULL;
    if (__atomic_load_n(&serving, __ATOMIC_SEQ_CST) && stream == serve_stream) {
        pending_error pending = set_aside();
        int64_t offset = serve((size_t)size);
        put_back(pending);
        if (offset >= 0 && (size_t)offset + (size_t)size <= arena_bytes) {
            __atomic_add_fetch(&counters[0], 1, __ATOMIC_SEQ_CST);
            add_allocated(size);
            return arena + offset;
        }
    }
    void *ptr = fallback_alloc((size_t)size, stream);
    if (ptr == NULL) return NULL;
    __atomic_add_fetch(&counters[1], 1, __ATOMIC_SEQ_CST);
    add_allocated(size);
    if (__atomic_load_n(&recording, __ATOMIC_SEQ_CST) && stream == serve_stream) {
        pending_error pending = set_aside();
        record_alloc(ptr, (size_t)size);
        put_back(pending);
    }
    return ptr;
}

void memo_free(void *ptr, size_t size, int device, void *stream) {
    (void)device;
    if (ptr == NULL) return;
    add_allocated(-(int64_t)size);
    char *p = ptr;
    if (arena != NULL && p >= arena && p < arena + arena_bytes) {
        pending_error pending = set_aside();
        release(p - arena);
        put_back(pending);
        return;
    }
    if (__atomic_load_n(&recording, __ATOMIC_SEQ_CST)) {
        pending_error pending = set_aside();
        record_free(ptr);
        put_back(pending);
    }
    __atomic_add_fetch(&counters[2], 1, __ATOMIC_SEQ_CST);
    fallback_free(ptr, stream);
}
