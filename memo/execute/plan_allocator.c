/* The allocator entry points PyTorch's CUDAPluggableAllocator calls for every tensor request
 * (memo/execute/cuda_arena.py builds, loads and configures this file).
 *
 * While serving is on, a request asks the plan server (a Python callback, memo.execute.plan_server)
 * for an arena offset; -1 means "not planned" and the request goes to the fallback allocator. A free
 * inside the arena goes back to the server; any other free to the fallback. While recording is on,
 * fallback requests and frees are also reported, so that one step's requests can be traced. The
 * fallback functions and the arena are given by the caller: cudaMallocAsync / cudaFreeAsync and one
 * cudaMalloc'd arena on a GPU, the C library's malloc / free and a host buffer in the tests.
 *
 * No CUDA header is needed: streams are opaque pointers. Calls come from any thread (the autograd
 * engine's included); the counters are atomic, and the Python callbacks take the GIL themselves.
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

/* counters[]: served requests, fallback requests, fallback frees, bytes allocated now (served and
 * fallback, as asked for), most bytes allocated at once. */
static int64_t counters[5];

void memo_configure(void *arena_ptr, size_t arena_size, serve_fn s, release_fn r, record_alloc_fn ra,
                    record_free_fn rf, fallback_alloc_fn fa, fallback_free_fn ff) {
    arena = arena_ptr;
    arena_bytes = arena_size;
    serve = s;
    release = r;
    record_alloc = ra;
    record_free = rf;
    fallback_alloc = fa;
    fallback_free = ff;
}

/* On a GPU the fallback is CUDA's stream-ordered allocator (cudaMallocAsync, whose pool caches). */
typedef int (*cuda_malloc_async_fn)(void **ptr, size_t size, void *stream);
typedef int (*cuda_free_async_fn)(void *ptr, void *stream);
static cuda_malloc_async_fn cuda_malloc_async;
static cuda_free_async_fn cuda_free_async;

static void *cuda_fallback_alloc(size_t size, void *stream) {
    void *ptr = NULL;
    return cuda_malloc_async(&ptr, size, stream) == 0 ? ptr : NULL;
}

static void cuda_fallback_free(void *ptr, void *stream) { cuda_free_async(ptr, stream); }

void memo_use_cuda_fallback(cuda_malloc_async_fn m, cuda_free_async_fn f) {
    cuda_malloc_async = m;
    cuda_free_async = f;
    fallback_alloc = cuda_fallback_alloc;
    fallback_free = cuda_fallback_free;
}

void memo_set_modes(int serve_on, int record_on) {
    __atomic_store_n(&serving, serve_on, __ATOMIC_SEQ_CST);
    __atomic_store_n(&recording, record_on, __ATOMIC_SEQ_CST);
}

void memo_counters(int64_t out[5]) {
    for (int i = 0; i < 5; i++) out[i] = __atomic_load_n(&counters[i], __ATOMIC_SEQ_CST);
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
    if (__atomic_load_n(&serving, __ATOMIC_SEQ_CST)) {
        int64_t offset = serve((size_t)size);
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
    if (__atomic_load_n(&recording, __ATOMIC_SEQ_CST)) record_alloc(ptr, (size_t)size);
    return ptr;
}

void memo_free(void *ptr, size_t size, int device, void *stream) {
    (void)device;
    if (ptr == NULL) return;
    add_allocated(-(int64_t)size);
    char *p = ptr;
    if (arena != NULL && p >= arena && p < arena + arena_bytes) {
        release(p - arena);
        return;
    }
    if (__atomic_load_n(&recording, __ATOMIC_SEQ_CST)) record_free(ptr);
    __atomic_add_fetch(&counters[2], 1, __ATOMIC_SEQ_CST);
    fallback_free(ptr, stream);
}
