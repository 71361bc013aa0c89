/* test_client.c - sl_fetch_client on its own: the default endpoint and its folder
 * rules, what it says when no fetcher answers or a fetcher refuses it, and bad
 * arguments. (Serving is tested against the real fetcher in test_fetcher.c.) */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "client.h"
#include "proto.h"
#include "run_cmd.h"

static char dir[64];

static void setup(void)
{
    strcpy(dir, "/tmp/sl-client-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void)
{
    sl_test_rm_rf(dir);
}

TestSuite(client, .init = setup, .fini = teardown, .timeout = 30);

Test(client, default_endpoint_lives_in_a_private_folder)
{
    char ep[256];
    sl_err err = {0};
    setenv("XDG_RUNTIME_DIR", dir, 1);
    cr_assert_eq(sl_fetch_default_endpoint(ep, sizeof ep, 0x1234abcdull, 1, &err), 0, "%s",
                 err.msg);
    char want[256];
    snprintf(want, sizeof want, "ipc://%s/sluice/%016llx.sock", dir, 0x1234abcdull);
    cr_assert_str_eq(ep, want);
    char sub[128];
    snprintf(sub, sizeof sub, "%s/sluice", dir);
    struct stat st;
    cr_assert_eq(stat(sub, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0700, "the socket folder is closed to others");
    /* A folder open to others is refused. */
    cr_assert_eq(chmod(sub, 0755), 0);
    cr_assert_eq(sl_fetch_default_endpoint(ep, sizeof ep, 1, 1, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "0700"), "%s", err.msg);
    /* A path too long for a unix socket is refused, not cut. */
    char deep[300];
    memset(deep, 'd', sizeof deep);
    deep[0] = '/';
    deep[sizeof deep - 1] = '\0';
    setenv("XDG_RUNTIME_DIR", deep, 1);
    cr_assert_neq(sl_fetch_default_endpoint(ep, sizeof ep, 1, 0, &err), 0);
    unsetenv("XDG_RUNTIME_DIR");
}

Test(client, no_fetcher_is_a_clear_error_after_the_wait)
{
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://%s/nobody.sock", dir);
    sl_fetch_client_options o;
    sl_fetch_client_options_default(&o, ep);
    o.connect_ms = 300;
    sl_fetch_client *c = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_open(&c, &o, &err), SL_EPEER);
    cr_assert_null(c);
    cr_assert(strstr(err.msg, "no fetcher answered") && strstr(err.msg, "nobody.sock"), "%s",
              err.msg);
    o.endpoint = NULL;
    cr_assert_eq(sl_fetch_client_open(&c, &o, &err), SL_EINVAL);
}

/* A fake fetcher (a plain ROUTER) that answers every HELLO with a given ERROR. */
Test(client, refusals_of_the_handshake_are_reported)
{
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://%s/fake.sock", dir);
    pid_t pid = fork();
    if (pid == 0) {
        void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
        if (zmq_bind(r, ep) != 0) _exit(1);
        for (int answered = 0; answered < 2;) {
            uint8_t id[256], buf[SL_PROTO_FRAME_MAX];
            int idn = zmq_recv(r, id, sizeof id, 0);
            int n = zmq_recv(r, buf, sizeof buf, 0);
            sl_proto_msg m;
            if (idn < 0 || n < 0 || sl_proto_decode(buf, (size_t)n, &m, NULL)) continue;
            if (m.type != SL_PROTO_HELLO) continue;
            sl_proto_msg e;
            memset(&e, 0, sizeof e);
            e.type = SL_PROTO_ERROR;
            e.error.code = answered == 0 ? SL_PROTO_ERR_MODEL : SL_PROTO_ERR_VERSION;
            sl_proto_set_text(e.error.text, "refused by the test");
            size_t len;
            sl_proto_encode(&e, buf, sizeof buf, &len, NULL);
            zmq_send(r, id, (size_t)idn, ZMQ_SNDMORE);
            zmq_send(r, buf, len, 0);
            answered++;
        }
        usleep(200000);
        _exit(0);
    }
    sl_fetch_client_options o;
    sl_fetch_client_options_default(&o, ep);
    o.connect_ms = 5000;
    o.fingerprint = 77;
    sl_fetch_client *c = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_fetch_client_open(&c, &o, &err), SL_EMISMATCH, "%s", err.msg);
    cr_assert(strstr(err.msg, "ERR_MODEL") || strstr(err.msg, "MODEL"), "%s", err.msg);
    cr_assert(strstr(err.msg, "refused by the test"), "%s", err.msg);
    cr_assert_eq(sl_fetch_client_open(&c, &o, &err), SL_EPEER, "%s", err.msg);
    cr_assert(strstr(err.msg, "VERSION"), "%s", err.msg);
    int st;
    waitpid(pid, &st, 0);
}
