/* fuzz_proto.c - libFuzzer target for the control protocol decoder (ipc/proto.h).
 *
 * Each input is one frame. The decoder must either reject it with a message or accept it;
 * what it accepts must encode again, the encoding must decode to the same message and
 * re-encode to the same bytes (the round trip is stable), and the canonical encoding is
 * never longer than the input. The input is also run through sl_proto_set_text(), whose
 * output must always be valid ERROR text. Any breach aborts, which libFuzzer reports.
 *
 * Build: CC=clang cmake -B build-fuzz-proto -DSL_FUZZ=ON -DSL_CUDA=OFF
 *        cmake --build build-fuzz-proto --target fuzz_proto
 * Run:   ./build-fuzz-proto/bin/fuzz_proto -max_total_time=60 -max_len=8300 CORPUS_DIR
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto.h"

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_proto: %s failed at line %d (%s)\n", #cond, __LINE__, err.msg);  \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static void fuzz_text(const uint8_t *data, size_t size)
{
    char src[2 * SL_PROTO_TEXT_MAX + 1];
    size_t n = size < sizeof src - 1 ? size : sizeof src - 1;
    memcpy(src, data, n);
    src[n] = '\0';

    sl_err err = {0};
    sl_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = SL_PROTO_ERROR;
    m.error.code = SL_PROTO_ERR_INTERNAL;
    sl_proto_set_text(m.error.text, src);
    CHECK(strlen(m.error.text) <= SL_PROTO_TEXT_MAX);
    uint8_t buf[SL_PROTO_FRAME_MAX];
    size_t len;
    CHECK(sl_proto_encode(&m, buf, sizeof buf, &len, &err) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    sl_err err = {0};
    sl_proto_msg a, b;
    int rc = sl_proto_decode(data, size, &a, &err);
    fuzz_text(data, size);
    if (rc) {
        CHECK(rc == SL_EFORMAT || rc == SL_EUNSUPPORTED || rc == SL_EMISMATCH || rc == SL_ENOMEM);
        CHECK(err.code == rc && err.msg[0] != '\0');
        return 0;
    }

    static uint8_t e1[SL_PROTO_FRAME_MAX], e2[SL_PROTO_FRAME_MAX];
    size_t n1 = 0, n2 = 0;
    CHECK(sl_proto_encode(&a, e1, sizeof e1, &n1, &err) == 0);
    CHECK(n1 <= size);
    CHECK(sl_proto_decode(e1, n1, &b, &err) == 0);
    CHECK(memcmp(&a, &b, sizeof a) == 0);
    CHECK(sl_proto_encode(&b, e2, sizeof e2, &n2, &err) == 0);
    CHECK(n1 == n2 && memcmp(e1, e2, n1) == 0);

    sl_proto_limits lim = {40, 384, 7376};
    rc = sl_proto_check(&a, &lim, &err);
    CHECK(rc == 0 || (rc == SL_EINVAL && err.msg[0] != '\0'));
    return 0;
}
