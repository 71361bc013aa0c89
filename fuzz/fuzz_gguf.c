/* fuzz_gguf.c - libFuzzer target of the GGUF header parser: each input becomes the
 * contents of a memfd opened with sl_gguf_open_fd, then closed. The parser must
 * never crash, read out of bounds or allocate much more than the input's size;
 * an opened file is also looked through (every tensor and key found by name,
 * every value printed) so that what the parser accepted is exercised too.
 *
 * Build: CC=clang cmake -B build-fuzz -DSL_FUZZ=ON -DSL_CUDA=OFF
 *        cmake --build build-fuzz --target fuzz_gguf
 * Run:   ./build-fuzz/bin/fuzz_gguf -max_total_time=30 fuzz/corpus
 */
#include "gguf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int fd = -1;
    static FILE *sink;
    if (fd < 0) {
        fd = memfd_create("fuzz_gguf", MFD_CLOEXEC);
        sink = fopen("/dev/null", "w");
        if (fd < 0 || !sink) abort();
    }
    if (ftruncate(fd, 0) != 0) abort();
    if (size && pwrite(fd, data, size, 0) != (ssize_t)size) abort();

    sl_gguf *g = NULL;
    sl_err err = {0};
    int rc = sl_gguf_open_fd(&g, fd, "fuzz", &err);
    if (rc != 0) {
        if (g || rc >= 0 || err.code != rc || !err.msg[0]) abort();
        return 0;
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const sl_gguf_tensor *t = &g->tensors[i];
        if (t->offset > g->shards[0].file_bytes || t->n_bytes > g->shards[0].file_bytes - t->offset)
            abort();
        if (strlen(t->name.s) == t->name.len && sl_gguf_find_tensor(g, t->name.s) != t) abort();
    }
    for (uint64_t i = 0; i < g->shards[0].n_kv; i++) {
        const sl_gguf_kv *kv = &g->shards[0].kv[i];
        if (strlen(kv->key.s) == kv->key.len && sl_gguf_find_kv(g, kv->key.s) != kv) abort();
        sl_gguf_print_kv(sink, kv);
        uint64_t u;
        int64_t arr[8];
        uint64_t n;
        sl_gguf_get_u64(g, kv->key.s, &u, &err);
        sl_gguf_get_arr_i64(g, kv->key.s, arr, 8, &n, &err);
    }
    sl_gguf_close(&g);
    return 0;
}
