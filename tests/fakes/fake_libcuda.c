/*
 * A stand-in for libcuda.so.1, for tests on machines without an NVIDIA GPU.
 *
 * It exports the driver calls kvcached's cuda backend makes (and
 * cuGetProcAddress_v2, through which cuda-python finds them), with the real
 * signatures and status codes, and keeps device memory in host memory:
 * a reservation is mmap(PROT_NONE), a handle is a memfd, cuMemMap maps the
 * memfd (still PROT_NONE), cuMemSetAccess makes it read-write; cuMemSetAccess
 * and cuMemUnmap take one mapping or a run of adjacent ones. It checks what
 * the real driver checks and a little more, so a marshalling mistake (wrong
 * struct layout, wrong enum, a missing context) fails here instead of on a GPU:
 *   - CUmemAllocationProp: type PINNED, location DEVICE with the device's id,
 *     no handle types; CUmemAccessDesc: location DEVICE, flags READWRITE;
 *   - alignment, sizes and offsets: multiples of the granularity, offset 0;
 *   - VMM calls, cuMemGetInfo and cuCtxSynchronize need a current context.
 * FAKE_CUDA_NOOP=1 skips the memory work (handles and mappings are only
 * counted), to time what the Python layers above cost. FAKE_CUDA_TOTAL sets
 * the device's memory in bytes (default 1 GiB).
 *
 * Build: cc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_libcuda.c -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUcontext;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NOT_FOUND = 500,
};

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#define GRANULARITY (2ULL << 20)
#define NDEV 2
#define MAXOBJ 4096

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int noop;
static unsigned long long total_bytes = 1ULL << 30;
static unsigned long long used_bytes;
static struct { int dummy; } primary[NDEV];
static int primary_refs[NDEV];
static __thread CUcontext current;
static __thread CUcontext stack[16];
static __thread int depth;

/* counters a test can read through fake_cuda_counter(name) */
static long n_set_current, n_push, n_pop, n_get_current, n_create, n_release, n_map, n_unmap, n_access;

typedef struct { unsigned long long size; int fd; int live; int released; int mapped; } Handle;
static Handle handles[MAXOBJ];
typedef struct { CUdeviceptr va; unsigned long long size; int live; } Range;
static Range reservations[MAXOBJ];
typedef struct { CUdeviceptr va; unsigned long long size; int handle; int live; } Mapping;
static Mapping mappings[MAXOBJ];

static void init_env(void) {
  const char *t = getenv("FAKE_CUDA_TOTAL");
  if (t) total_bytes = strtoull(t, NULL, 10);
  const char *n = getenv("FAKE_CUDA_NOOP");
  noop = n && n[0] == '1';
}

static int ctx_device(CUcontext c) {
  for (int i = 0; i < NDEV; i++) if (c == (CUcontext)&primary[i]) return i;
  return -1;
}

#define NEED_INIT() do { if (!initialized) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { NEED_INIT(); if (!current) return CUDA_ERROR_INVALID_CONTEXT; } while (0)

CUresult cuInit(unsigned int flags) {
  if (flags) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  if (!initialized) { init_env(); initialized = 1; }
  pthread_mutex_unlock(&lock);
  return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int *v) { if (!v) return CUDA_ERROR_INVALID_VALUE; *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  NEED_INIT();
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal; return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int *n) { NEED_INIT(); *n = NDEV; return CUDA_SUCCESS; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  NEED_INIT();
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(name, (size_t)len, "Fake CUDA Device %d", d); return CUDA_SUCCESS;
}
CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice d) {
  NEED_INIT();
  if (!bus || len < 13) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
  snprintf(bus, (size_t)len, "00000000:%02X:00.0", 0x19 + d); return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
  NEED_INIT();
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = total_bytes; return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  NEED_INIT();
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&lock); primary_refs[d]++; pthread_mutex_unlock(&lock);
  *c = (CUcontext)&primary[d]; return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  NEED_INIT();
  if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&lock);
  CUresult r = primary_refs[d] > 0 ? (primary_refs[d]--, CUDA_SUCCESS) : CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_unlock(&lock);
  return r;
}
CUresult cuCtxSetCurrent(CUcontext c) {
  NEED_INIT();
  if (c && ctx_device(c) < 0) return CUDA_ERROR_INVALID_CONTEXT;
  __atomic_add_fetch(&n_set_current, 1, __ATOMIC_RELAXED);
  current = c; return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *c) {
  NEED_INIT();
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  __atomic_add_fetch(&n_get_current, 1, __ATOMIC_RELAXED);
  *c = current; return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(CUcontext c) {
  NEED_INIT();
  if (!c || ctx_device(c) < 0 || depth >= 16) return CUDA_ERROR_INVALID_CONTEXT;
  __atomic_add_fetch(&n_push, 1, __ATOMIC_RELAXED);
  stack[depth++] = current; current = c; return CUDA_SUCCESS;
}
CUresult cuCtxPopCurrent_v2(CUcontext *c) {
  NEED_INIT();
  if (depth <= 0) return CUDA_ERROR_INVALID_CONTEXT;
  __atomic_add_fetch(&n_pop, 1, __ATOMIC_RELAXED);
  if (c) *c = current;
  current = stack[--depth]; return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void) { NEED_CTX(); return CUDA_SUCCESS; }

CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total_b) {
  NEED_CTX();
  if (!free_b || !total_b) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  *free_b = total_bytes - used_bytes; *total_b = total_bytes;
  pthread_mutex_unlock(&lock);
  return CUDA_SUCCESS;
}

static int prop_ok(const CUmemAllocationProp *p) {
  return p && p->type == 1 /* PINNED */ && p->requestedHandleTypes == 0 &&
         p->location.type == 1 /* DEVICE */ && p->location.id >= 0 && p->location.id < NDEV &&
         p->win32HandleMetaData == NULL;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
  NEED_INIT();
  if (!g || !prop_ok(p) || (option != 0 && option != 1)) return CUDA_ERROR_INVALID_VALUE;
  *g = GRANULARITY; return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
  NEED_CTX();
  if (!ptr || !size || size % GRANULARITY || flags) return CUDA_ERROR_INVALID_VALUE;
  if (alignment && (alignment % GRANULARITY || (alignment & (alignment - 1)))) return CUDA_ERROR_INVALID_VALUE;
  (void)addr;
  size_t align = alignment ? alignment : GRANULARITY;
  void *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t va = ((uintptr_t)raw + align - 1) / align * align;
  if (va > (uintptr_t)raw) munmap(raw, va - (uintptr_t)raw);
  uintptr_t end = (uintptr_t)raw + size + align;
  if (end > va + size) munmap((void *)(va + size), end - (va + size));
  pthread_mutex_lock(&lock);
  int i = 0;
  while (i < MAXOBJ && reservations[i].live) i++;
  if (i == MAXOBJ) { pthread_mutex_unlock(&lock); munmap((void *)va, size); return CUDA_ERROR_OUT_OF_MEMORY; }
  reservations[i].va = va; reservations[i].size = size; reservations[i].live = 1;
  pthread_mutex_unlock(&lock);
  *ptr = va; return CUDA_SUCCESS;
}

static int overlaps_mapping(CUdeviceptr va, unsigned long long size) {
  for (int i = 0; i < MAXOBJ; i++)
    if (mappings[i].live && va < mappings[i].va + mappings[i].size && mappings[i].va < va + size) return 1;
  return 0;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  NEED_CTX();
  pthread_mutex_lock(&lock);
  int i = 0;
  while (i < MAXOBJ && !(reservations[i].live && reservations[i].va == ptr && reservations[i].size == size)) i++;
  if (i == MAXOBJ || overlaps_mapping(ptr, size)) { pthread_mutex_unlock(&lock); return CUDA_ERROR_INVALID_VALUE; }
  reservations[i].live = 0;
  pthread_mutex_unlock(&lock);
  munmap((void *)ptr, size);
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p, unsigned long long flags) {
  NEED_CTX();
  if (!h || !size || size % GRANULARITY || flags || !prop_ok(p)) return CUDA_ERROR_INVALID_VALUE;
  __atomic_add_fetch(&n_create, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&lock);
  if (used_bytes + size > total_bytes) { pthread_mutex_unlock(&lock); return CUDA_ERROR_OUT_OF_MEMORY; }
  int i = 0;
  while (i < MAXOBJ && handles[i].live) i++;
  if (i == MAXOBJ) { pthread_mutex_unlock(&lock); return CUDA_ERROR_OUT_OF_MEMORY; }
  int fd = -1;
  if (!noop) {
    fd = memfd_create("fake-cuda", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
      if (fd >= 0) close(fd);
      pthread_mutex_unlock(&lock); return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  handles[i].size = size; handles[i].fd = fd; handles[i].live = 1; handles[i].released = 0; handles[i].mapped = 0;
  used_bytes += size;
  pthread_mutex_unlock(&lock);
  *h = (CUmemGenericAllocationHandle)(0x1000 + i); return CUDA_SUCCESS;
}

static int handle_index(CUmemGenericAllocationHandle h) {
  long i = (long)h - 0x1000;
  return (i >= 0 && i < MAXOBJ && handles[i].live && !handles[i].released) ? (int)i : -1;
}

static void maybe_free(int i) {
  if (handles[i].released && handles[i].mapped == 0) {
    if (handles[i].fd >= 0) close(handles[i].fd);
    handles[i].live = 0; used_bytes -= handles[i].size;
  }
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  NEED_CTX();
  __atomic_add_fetch(&n_release, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&lock);
  int i = handle_index(h);
  if (i < 0) { pthread_mutex_unlock(&lock); return CUDA_ERROR_INVALID_VALUE; }
  handles[i].released = 1; maybe_free(i);
  pthread_mutex_unlock(&lock);
  return CUDA_SUCCESS;
}

static int inside_reservation(CUdeviceptr va, unsigned long long size) {
  for (int i = 0; i < MAXOBJ; i++)
    if (reservations[i].live && va >= reservations[i].va && va + size <= reservations[i].va + reservations[i].size) return 1;
  return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  NEED_CTX();
  __atomic_add_fetch(&n_map, 1, __ATOMIC_RELAXED);
  if (!size || size % GRANULARITY || ptr % GRANULARITY || offset || flags) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int i = handle_index(h);
  CUresult r = CUDA_SUCCESS;
  if (i < 0 || handles[i].size != size || !inside_reservation(ptr, size) || overlaps_mapping(ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
  int m = 0;
  if (!r) { while (m < MAXOBJ && mappings[m].live) m++; if (m == MAXOBJ) r = CUDA_ERROR_OUT_OF_MEMORY; }
  if (!r && !noop && mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handles[i].fd, 0) == MAP_FAILED) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (!r) { mappings[m].va = ptr; mappings[m].size = size; mappings[m].handle = i; mappings[m].live = 1; handles[i].mapped++; }
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  NEED_CTX();
  __atomic_add_fetch(&n_access, 1, __ATOMIC_RELAXED);
  if (!desc || count != 1 || !size || size % GRANULARITY || ptr % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
  if (desc[0].location.type != 1 || desc[0].location.id < 0 || desc[0].location.id >= NDEV || desc[0].flags != 3)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  /* the range must be covered by whole mappings */
  CUdeviceptr pos = ptr;
  while (pos < ptr + size) {
    int m = 0;
    while (m < MAXOBJ && !(mappings[m].live && mappings[m].va == pos)) m++;
    if (m == MAXOBJ) { pthread_mutex_unlock(&lock); return CUDA_ERROR_INVALID_VALUE; }
    pos += mappings[m].size;
  }
  pthread_mutex_unlock(&lock);
  if (pos != ptr + size) return CUDA_ERROR_INVALID_VALUE;
  if (!noop && mprotect((void *)ptr, size, PROT_READ | PROT_WRITE) != 0) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  NEED_CTX();
  __atomic_add_fetch(&n_unmap, 1, __ATOMIC_RELAXED);
  if (!size || size % GRANULARITY || ptr % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  /* the range must be covered by whole mappings (one or a run of adjacent
     ones, as the real driver takes); all are checked before any is removed */
  CUdeviceptr pos = ptr;
  while (pos < ptr + size) {
    int m = 0;
    while (m < MAXOBJ && !(mappings[m].live && mappings[m].va == pos)) m++;
    if (m == MAXOBJ) { pthread_mutex_unlock(&lock); return CUDA_ERROR_INVALID_VALUE; }
    pos += mappings[m].size;
  }
  if (pos != ptr + size) { pthread_mutex_unlock(&lock); return CUDA_ERROR_INVALID_VALUE; }
  if (!noop) mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  for (pos = ptr; pos < ptr + size;) {
    int m = 0;
    while (!(mappings[m].live && mappings[m].va == pos)) m++;
    pos += mappings[m].size;
    mappings[m].live = 0;
    int i = mappings[m].handle;
    handles[i].mapped--; maybe_free(i);
  }
  pthread_mutex_unlock(&lock);
  return CUDA_SUCCESS;
}

static const char *error_name(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    default: return NULL;
  }
}
CUresult cuGetErrorName(CUresult r, const char **s) {
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  *s = error_name(r); return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuGetErrorString(CUresult r, const char **s) { return cuGetErrorName(r, s); }

/* cuda-python finds every entry point through here, by base name and version. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
  (void)version; (void)flags;
  static const struct { const char *name; void *fn; } table[] = {
    {"cuInit", (void *)cuInit}, {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGet", (void *)cuDeviceGet}, {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGetName", (void *)cuDeviceGetName}, {"cuDeviceGetPCIBusId", (void *)cuDeviceGetPCIBusId},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent}, {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuCtxPushCurrent", (void *)cuCtxPushCurrent_v2}, {"cuCtxPopCurrent", (void *)cuCtxPopCurrent_v2},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize}, {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity},
    {"cuMemAddressReserve", (void *)cuMemAddressReserve}, {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemCreate", (void *)cuMemCreate}, {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemMap", (void *)cuMemMap}, {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemSetAccess", (void *)cuMemSetAccess},
    {"cuGetErrorName", (void *)cuGetErrorName}, {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuGetProcAddress", (void *)cuGetProcAddress_v2},
  };
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
    if (strcmp(symbol, table[i].name) == 0) {
      *pfn = table[i].fn;
      if (status) *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
      return CUDA_SUCCESS;
    }
  }
  *pfn = NULL;
  if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  return CUDA_ERROR_NOT_FOUND;
}

/* For tests: read a call counter by name. */
long fake_cuda_counter(const char *name) {
  if (!strcmp(name, "cuCtxSetCurrent")) return n_set_current;
  if (!strcmp(name, "cuCtxGetCurrent")) return n_get_current;
  if (!strcmp(name, "cuCtxPushCurrent")) return n_push;
  if (!strcmp(name, "cuCtxPopCurrent")) return n_pop;
  if (!strcmp(name, "cuMemCreate")) return n_create;
  if (!strcmp(name, "cuMemRelease")) return n_release;
  if (!strcmp(name, "cuMemMap")) return n_map;
  if (!strcmp(name, "cuMemUnmap")) return n_unmap;
  if (!strcmp(name, "cuMemSetAccess")) return n_access;
  return -1;
}
