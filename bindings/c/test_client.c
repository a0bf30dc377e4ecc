/*
 * test_client: checks of the C client that need no vectors (tests/bindings/test_c_client.py runs them).
 *
 *   test_client offline                          argument checks, the reply parser, error names: no network
 *   test_client live ENDPOINT                    error codes and fields against a real broker with an actor
 *   test_client attach ENDPOINT DEADLINE ATTEMPT one attach; prints "attached TASK attempts N"
 *                                                or "error CODE attempts N: MESSAGE" (exit 1)
 *   test_client generate ENDPOINT DEADLINE ATTEMPT TEXT_CAP
 *                                                a generate with a prompt and messages both (refused, nothing
 *                                                sent; prints "refused CODE attempts N: MESSAGE"), then one with
 *                                                messages into a TEXT_CAP-byte buffer; prints "generated n_tokens N
 *                                                finish_reason R policy_version V text_len L logprob P attempts N"
 *                                                and the text on the lines after it, or "error CODE attempts N:
 *                                                MESSAGE" (exit 1)
 *   test_client generate-live ENDPOINT           against a broker with a model: attach, a generate, its feedback
 *                                                (reward 1, done), detach; prints "generated task T n_tokens N
 *                                                finish_reason R policy_version V text_len L logprob P"
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ppoz.h"

static int checks = 0, failures = 0;

#define CHECK(cond)                                                                                                    \
    do {                                                                                                               \
        checks++;                                                                                                      \
        if (!(cond)) {                                                                                                 \
            failures++;                                                                                                \
            printf("FAIL line %d: %s\n", __LINE__, #cond);                                                             \
        }                                                                                                              \
    } while (0)

/* rc is `want` and the client names it with the same code. */
#define CHECK_RC(c, call, want)                                                                                        \
    do {                                                                                                               \
        int rc_ = (call);                                                                                              \
        checks++;                                                                                                      \
        if (rc_ != (want) || strcmp(ppoz_error_code(c), ppoz_strerror(want)) != 0) {                                   \
            failures++;                                                                                                \
            printf("FAIL line %d: %s returned %s (%s: %s), expected %s\n", __LINE__, #call, ppoz_strerror(rc_),        \
                   ppoz_error_code(c), ppoz_error_message(c), ppoz_strerror(want));                                    \
        }                                                                                                              \
    } while (0)

/* Whether `needle` occurs in `hay` (memmem is not standard C). */
static int contains(const char *hay, size_t n, const char *needle, size_t m)
{
    for (size_t i = 0; i + m <= n; i++)
        if (memcmp(hay + i, needle, m) == 0)
            return 1;
    return 0;
}

static int parse_bytes(const char *data, size_t len, ppoz_reply *r)
{
    return ppoz_parse_reply(data, len, r, NULL, 0);
}

/* The messages and sampling settings of the generate checks. */
static const char *const ROLES[] = {"system", "user"};
static const char *const CONTENTS[] = {"Be brief.", "Name a colour."};
static const char *const STOP[] = {"\n", "User:"};

static int offline(void)
{
    /* ppoz_open refuses what could never work */
    errno = 0;
    CHECK(ppoz_open(NULL, 1000, 100) == NULL && errno == EINVAL);
    CHECK(ppoz_open("tcp://127.0.0.1:9", 0, 100) == NULL && errno == EINVAL);
    CHECK(ppoz_open("tcp://127.0.0.1:9", 1000, -1) == NULL && errno == EINVAL);
    CHECK(ppoz_open("no-such-transport://x", 1000, 100) == NULL);

    ppoz_client *c = ppoz_open("tcp://127.0.0.1:9", 1000, 100); /* nothing is sent below */
    CHECK(c != NULL);
    if (c == NULL)
        return 1;
    CHECK(strcmp(ppoz_error_code(c), "ok") == 0 && ppoz_last_reply(c) == NULL);

    char small[8] = "";
    char task[PPOZ_TASK_ID_CAP] = "bad id!";
    int ready = 0, action = 0, version = 0;
    const char *const actions[] = {"0: TouchEvent(view=Cart)", NULL};
    CHECK_RC(c, ppoz_attach(c, NULL, PPOZ_TASK_ID_CAP), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK_RC(c, ppoz_attach(c, small, sizeof small), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "cap") != NULL);
    CHECK_RC(c, ppoz_attach(c, task, sizeof task), PPOZ_ERR_INVALID_ARGUMENT); /* not a valid task id */
    CHECK(strstr(ppoz_error_message(c), "task_id") != NULL);
    CHECK_RC(c, ppoz_ask(c, NULL, &ready, NULL), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK_RC(c, ppoz_ask(c, "emu-7", NULL, NULL), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK_RC(c, ppoz_step(c, "emu-7", "prompt", NULL, actions, 0, &action, &version), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "at least one candidate") != NULL);
    CHECK_RC(c, ppoz_step(c, "emu-7", "prompt", NULL, NULL, 1, &action, &version), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK_RC(c, ppoz_step(c, "emu-7", NULL, NULL, actions, 1, &action, &version), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK_RC(c, ppoz_step(c, "emu-7", "prompt", NULL, actions, 2, &action, &version), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "candidate action 1 is NULL") != NULL);
    CHECK_RC(c, ppoz_feedback(c, "emu-7", NAN, 0, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK_RC(c, ppoz_feedback(c, "emu-7", INFINITY, 0, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK_RC(c, ppoz_detach(c, ""), PPOZ_ERR_INVALID_ARGUMENT);

    /* generate: each bad argument is refused and named */
    const char *const null_role[] = {"system", NULL};
    const char *const null_content[] = {NULL, "Name a colour."};
    const char *const empty_stop[] = {"\n", ""};
    const ppoz_sampling good = {.max_new_tokens = 16, .temperature = 1.0, .top_p = 0.9, .stop = STOP, .n_stop = 2,
                                .has_seed = 1, .seed = 7};
    ppoz_sampling bad = good;
    char text[64] = "";
    size_t text_len = 0;
#define GENERATE(prompt, roles, contents, n, sampling, deadline)                                                        \
    ppoz_generate(c, "qa-3", prompt, roles, contents, n, sampling, deadline, text, sizeof text, &text_len, NULL, NULL, NULL)
    CHECK_RC(c, GENERATE(NULL, NULL, NULL, 0, &good, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "exactly one of `prompt` and `messages`") != NULL &&
          strstr(ppoz_error_message(c), "neither") != NULL);
    CHECK_RC(c, GENERATE("Q: 2 + 3 = ?", ROLES, CONTENTS, 2, &good, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "exactly one of `prompt` and `messages`") != NULL &&
          strstr(ppoz_error_message(c), "both") != NULL);
    CHECK_RC(c, GENERATE(NULL, NULL, CONTENTS, 2, &good, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "roles NULL") != NULL);
    CHECK_RC(c, GENERATE(NULL, ROLES, CONTENTS, 0, &good, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "n_messages >= 1") != NULL);
    CHECK_RC(c, GENERATE(NULL, null_role, CONTENTS, 2, &good, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`messages[1].role` is NULL") != NULL);
    CHECK_RC(c, GENERATE(NULL, ROLES, null_content, 2, &good, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`messages[0].content` is NULL") != NULL);
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, NULL, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling` is NULL") != NULL);
    bad.max_new_tokens = 0;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.max_new_tokens` must be at least 1, got 0") != NULL);
    bad = good;
    bad.temperature = -0.5;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.temperature`") != NULL);
    bad.temperature = NAN;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.temperature`") != NULL);
    bad = good;
    bad.top_p = 0.0; /* a zeroed ppoz_sampling: top_p must be set */
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.top_p` must be in (0, 1], got 0") != NULL);
    bad.top_p = 1.5;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    bad.top_p = NAN;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.top_p`") != NULL);
    bad = good;
    bad.stop = empty_stop;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.stop[1]` must be a non-empty string") != NULL);
    bad.stop = NULL;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.stop` is NULL") != NULL);
    bad = good;
    bad.seed = -1;
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &bad, 0), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`sampling.seed`") != NULL);
    CHECK_RC(c, GENERATE("p", NULL, NULL, 0, &good, -1), PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`deadline_ms`") != NULL);
#undef GENERATE
    CHECK_RC(c, ppoz_generate(c, "qa-3", "p", NULL, NULL, 0, &good, 0, NULL, 8, NULL, NULL, NULL, NULL),
             PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "`text` is NULL") != NULL);
    CHECK_RC(c, ppoz_generate(c, "bad id!", "p", NULL, NULL, 0, &good, 0, text, sizeof text, NULL, NULL, NULL, NULL),
             PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strstr(ppoz_error_message(c), "task_id") != NULL);
    CHECK(ppoz_attempts(c) == 0); /* none of these reached the network */
    CHECK(ppoz_attach(NULL, task, sizeof task) == PPOZ_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(ppoz_error_code(NULL), "invalid_argument") == 0);
    ppoz_close(c);
    ppoz_close(NULL);

    /* names and codes */
    CHECK(ppoz_code_to_rc("unknown_task") == PPOZ_ERR_UNKNOWN_TASK);
    CHECK(ppoz_code_to_rc("timeout") == PPOZ_ERR_TIMEOUT);
    CHECK(ppoz_code_to_rc("internal") == PPOZ_ERR_INTERNAL);
    CHECK(ppoz_code_to_rc("invalid_argument") == PPOZ_ERR_PROTOCOL); /* local names are not protocol codes */
    CHECK(ppoz_code_to_rc("no_such_code") == PPOZ_ERR_PROTOCOL);
    CHECK(ppoz_code_to_rc(NULL) == PPOZ_ERR_PROTOCOL);
    CHECK(strcmp(ppoz_strerror(PPOZ_ERR_FEEDBACK_WITHOUT_STEP), "feedback_without_step") == 0);
    CHECK(strcmp(ppoz_strerror(42), "unknown") == 0);
    CHECK(strcmp(ppoz_op_name(PPOZ_OP_RAG_STEP), "rag_step") == 0 && ppoz_op_name((ppoz_op)99) == NULL);
    CHECK(strcmp(ppoz_op_name(PPOZ_OP_GENERATE), "generate") == 0);

    /* the encoder */
    char *data = NULL;
    size_t len = 0;
    char why[256] = "";
    ppoz_request req = {.op = PPOZ_OP_ASK, .rid = "0123456789012345678901234567890123456789012345678901234567890123x",
                        .task_id = "emu-7"};
    CHECK(ppoz_encode_request(&req, &data, &len, why, sizeof why) == PPOZ_ERR_INVALID_ARGUMENT && data == NULL);
    CHECK(strstr(why, "rid") != NULL);
    req.rid = "k1";
    req.task_id = NULL;
    CHECK(ppoz_encode_request(&req, &data, &len, why, sizeof why) == PPOZ_ERR_INVALID_ARGUMENT);
    const char *const two[] = {"a", "b"};
    ppoz_request step = {.op = PPOZ_OP_STEP, .rid = "s1", .task_id = "emu-7", .prompt = "p", .actions = two,
                         .n_actions = 2, .deadline_ms = 500};
    CHECK(ppoz_encode_request(&step, &data, &len, why, sizeof why) == PPOZ_OK && data != NULL);
    /* header(4) + task_id + obs + deadline_ms = 7 fields; obs without question has 2 */
    CHECK(len > 0 && (unsigned char)data[0] == 0x87 && contains(data, len, "\xa6" "action\x92", 8));
    CHECK(contains(data, len, "\xab" "deadline_ms\xcd\x01\xf4", 15));
    free(data);
    /* generate: sampling without stop and seed has 3 keys; the largest seed is an int64 */
    ppoz_request gen = {.op = PPOZ_OP_GENERATE, .rid = "g1", .task_id = "qa-3", .prompt = "p",
                        .sampling = {.max_new_tokens = 1, .temperature = 0.0, .top_p = 1.0}};
    CHECK(ppoz_encode_request(&gen, &data, &len, why, sizeof why) == PPOZ_OK && (unsigned char)data[0] == 0x87);
    CHECK(contains(data, len, "\xa8" "sampling\x83\xae" "max_new_tokens\x01", 26));
    free(data);
    gen.sampling.has_seed = 1;
    gen.sampling.seed = INT64_MAX;
    CHECK(ppoz_encode_request(&gen, &data, &len, why, sizeof why) == PPOZ_OK);
    CHECK(contains(data, len, "\xa8" "sampling\x84", 10) && contains(data, len, "\xa4seed\xcf\x7f\xff\xff\xff\xff\xff\xff\xff", 14));
    free(data);

    /* the parser */
    ppoz_reply r;
    CHECK(parse_bytes("\xc1", 1, &r) == PPOZ_ERR_PROTOCOL);                     /* never used byte */
    CHECK(parse_bytes("\x91\x01", 2, &r) == PPOZ_ERR_PROTOCOL);                 /* an array */
    CHECK(parse_bytes("\x81\xa3rid\xa2k1\x00", 9, &r) == PPOZ_ERR_PROTOCOL);    /* trailing byte */
    CHECK(parse_bytes("\x82\xa3rid\xa2k1", 7, &r) == PPOZ_ERR_PROTOCOL);        /* truncated */
    CHECK(parse_bytes("\x81\xa7task_id\x07", 10, &r) == PPOZ_ERR_PROTOCOL);     /* task_id not a str */
    CHECK(parse_bytes("\x81\xa5" "error\xa1x", 9, &r) == PPOZ_ERR_PROTOCOL);    /* error not a map */
    CHECK(parse_bytes("\x81\xa3rid\xc4\x02k1", 9, &r) == PPOZ_OK && r.has_rid && r.rid_len == 2 &&
          memcmp(r.rid, "k1", 2) == 0);                                          /* a bin rid */
    CHECK(parse_bytes("\x82\xa3rid\xc0\xa2op\xc0", 10, &r) == PPOZ_OK && !r.has_rid); /* nil rid and op */
    CHECK(parse_bytes("\x81\xa3xyz\x93\x01\x02\x03", 9, &r) == PPOZ_OK);         /* unknown fields are ignored */
    CHECK(parse_bytes("\x81\xa4text\x07", 7, &r) == PPOZ_ERR_PROTOCOL);          /* text not a str */
    CHECK(parse_bytes("\x81\xa8n_tokens\xa1x", 12, &r) == PPOZ_ERR_PROTOCOL);    /* n_tokens not an int */
    CHECK(parse_bytes("\x81\xad" "finish_reason\x01", 16, &r) == PPOZ_ERR_PROTOCOL); /* finish_reason not a str */
    CHECK(parse_bytes("\x82\xa4text\xa0\xa8n_tokens\x00", 17, &r) == PPOZ_OK && r.has_text && r.text_len == 0 &&
          r.text[0] == '\0' && r.has_n_tokens && r.n_tokens == 0);              /* an empty response */

    /* a text longer than the reply keeps: cut at a character boundary, never past the buffer */
    enum { CHARS = 40000 };                       /* "é" 40000 times: 80000 bytes */
    size_t big_len = 6 + 5 + 2 * CHARS;
    char *big = malloc(big_len);
    CHECK(big != NULL);
    if (big != NULL) {
        memcpy(big, "\x81\xa4text\xdb", 7);    /* a map of one key, a str 32 */
        memcpy(big + 7, "\x00\x01\x38\x80", 4); /* its length, 80000 = 0x00013880, big-endian */
        for (size_t i = 0; i < CHARS; i++)
            memcpy(big + 11 + 2 * i, "\xc3\xa9", 2);
        CHECK(parse_bytes(big, big_len, &r) == PPOZ_OK && r.has_text && r.text_truncated);
        CHECK(r.text_full_len == 2 * CHARS && r.text_len == PPOZ_TEXT_CAP - 2); /* 65535 bytes cut to whole characters */
        CHECK(r.text[r.text_len] == '\0' && strlen(r.text) == r.text_len &&
              memcmp(r.text + r.text_len - 2, "\xc3\xa9", 2) == 0);
        free(big);
    }
    return 0;
}

static int live(const char *endpoint)
{
    ppoz_client *c = ppoz_open(endpoint, 60000, 10000);
    CHECK(c != NULL);
    if (c == NULL)
        return 1;
    int64_t t = 0;
    CHECK_RC(c, ppoz_ping(c, &t), PPOZ_OK);
    CHECK(t > 0);

    char task[PPOZ_TASK_ID_CAP] = "";
    CHECK_RC(c, ppoz_attach(c, task, sizeof task), PPOZ_OK);
    CHECK(task[0] != '\0');
    CHECK(ppoz_last_reply(c) != NULL && ppoz_last_reply(c)->resumed == 0);

    unsigned long before = ppoz_attempts(c);
    CHECK_RC(c, ppoz_feedback(c, task, 1.0, 0, 0), PPOZ_ERR_FEEDBACK_WITHOUT_STEP);
    CHECK(ppoz_attempts(c) == before + 1); /* not retried */

    int ready = -1, wait_ms = -1;
    CHECK_RC(c, ppoz_ask(c, task, &ready, &wait_ms), PPOZ_OK);
    CHECK(ready == 1 && wait_ms == 0);

    const char *const actions[] = {"0: TouchEvent(view=Cart)", "1: TouchEvent(view=Search)", "2: KeyEvent(name=BACK)"};
    int action = -1, version = -1;
    CHECK_RC(c, ppoz_step(c, task, "Screen: MainActivity. History: none.", NULL, actions, 3, &action, &version), PPOZ_OK);
    CHECK(action >= 0 && action < 3 && version >= 0);
    const ppoz_reply *r = ppoz_last_reply(c);
    CHECK(r != NULL && r->has_logprob && r->logprob <= 0.0 && r->n_probs == 3);
    CHECK_RC(c, ppoz_feedback(c, task, 0.5, 1, 0), PPOZ_OK);
    CHECK(ppoz_last_reply(c)->segment_closed == 1); /* done closes the segment */

    /* generate: the broker reads the request and hands it to the actor, which serves no model (uniform policy) */
    const char *const user[] = {"user"}, *const colour[] = {"Name a colour."};
    ppoz_sampling sampling = {.max_new_tokens = 4, .temperature = 1.0, .top_p = 0.9, .stop = STOP, .n_stop = 2,
                              .has_seed = 1, .seed = 7};
    char text[64] = "";
    CHECK_RC(c, ppoz_generate(c, task, "Q: 2 + 3 = ?\nA:", NULL, NULL, 0, &sampling, 5000, text, sizeof text, NULL, NULL,
                              NULL, NULL),
             PPOZ_ERR_BAD_REQUEST);
    CHECK(strstr(ppoz_error_message(c), "serves no model") != NULL);
    CHECK_RC(c, ppoz_generate(c, task, NULL, user, colour, 1, &sampling, 0, text, sizeof text, NULL, NULL, NULL, NULL),
             PPOZ_ERR_BAD_REQUEST);
    CHECK(strstr(ppoz_error_message(c), "serves no model") != NULL);
    sampling.max_new_tokens = 5000; /* over the broker's default max_new_tokens (4096): refused by the broker itself */
    CHECK_RC(c, ppoz_generate(c, task, "p", NULL, NULL, 0, &sampling, 0, text, sizeof text, NULL, NULL, NULL, NULL),
             PPOZ_ERR_TOO_LARGE);
    CHECK(strstr(ppoz_error_message(c), "max_new_tokens") != NULL);
    sampling.max_new_tokens = 4;
    CHECK_RC(c, ppoz_generate(c, "never-attached", "p", NULL, NULL, 0, &sampling, 0, text, sizeof text, NULL, NULL, NULL,
                              NULL),
             PPOZ_ERR_UNKNOWN_TASK);

    enum { MANY = 300 }; /* over the broker's default max_actions (256) */
    const char *many[MANY];
    for (int i = 0; i < MANY; i++)
        many[i] = "x";
    CHECK_RC(c, ppoz_step(c, task, "p", NULL, many, MANY, &action, &version), PPOZ_ERR_TOO_LARGE);

    /* a client-chosen task id, attached twice: the second resumes it */
    char own[PPOZ_TASK_ID_CAP];
    snprintf(own, sizeof own, "c-live-%ld", (long)time(NULL));
    CHECK_RC(c, ppoz_attach(c, own, sizeof own), PPOZ_OK);
    CHECK_RC(c, ppoz_attach(c, own, sizeof own), PPOZ_OK);
    CHECK(ppoz_last_reply(c)->resumed == 1);
    CHECK_RC(c, ppoz_detach(c, own), PPOZ_OK);

    CHECK_RC(c, ppoz_ask(c, "never-attached", &ready, NULL), PPOZ_ERR_UNKNOWN_TASK);
    CHECK_RC(c, ppoz_detach(c, task), PPOZ_OK);
    CHECK_RC(c, ppoz_detach(c, task), PPOZ_ERR_UNKNOWN_TASK);
    CHECK_RC(c, ppoz_step(c, task, "p", NULL, actions, 3, &action, &version), PPOZ_ERR_UNKNOWN_TASK);
    ppoz_close(c);
    return 0;
}

static int generate_once(const char *endpoint, int deadline_ms, int attempt_ms, size_t text_cap)
{
    ppoz_client *c = ppoz_open(endpoint, deadline_ms, attempt_ms);
    char *text = text_cap > 0 ? malloc(text_cap) : NULL;
    if (c == NULL || (text_cap > 0 && text == NULL)) {
        printf("error open: %s\n", strerror(errno));
        ppoz_close(c);
        free(text);
        return 1;
    }
    const ppoz_sampling sampling = {.max_new_tokens = 8, .temperature = 0.7, .top_p = 0.95, .stop = STOP, .n_stop = 2,
                                    .has_seed = 1, .seed = 42};
    size_t text_len = 0;
    int n_tokens = -1, version = -1;
    const char *reason = NULL;
    /* a prompt and messages both: refused before anything is sent */
    int rc = ppoz_generate(c, "qa-3", "Name a colour.", ROLES, CONTENTS, 2, &sampling, 20000, text, text_cap, &text_len,
                           &n_tokens, &reason, &version);
    printf("refused %s attempts %lu: %s\n", ppoz_error_code(c), ppoz_attempts(c), ppoz_error_message(c));
    if (rc != PPOZ_ERR_INVALID_ARGUMENT) {
        ppoz_close(c);
        free(text);
        return 1;
    }
    rc = ppoz_generate(c, "qa-3", NULL, ROLES, CONTENTS, 2, &sampling, 20000, text, text_cap, &text_len, &n_tokens, &reason,
                       &version);
    if (rc == PPOZ_OK) {
        printf("generated n_tokens %d finish_reason %s policy_version %d text_len %zu logprob %g attempts %lu\n", n_tokens,
               reason, version, text_len, ppoz_last_reply(c)->logprob, ppoz_attempts(c));
        printf("%s\n", text_cap > 0 ? text : "");
    } else {
        printf("error %s attempts %lu: %s\n", ppoz_error_code(c), ppoz_attempts(c), ppoz_error_message(c));
    }
    ppoz_close(c);
    free(text);
    return rc == PPOZ_OK ? 0 : 1;
}

static int generate_live(const char *endpoint)
{
    ppoz_client *c = ppoz_open(endpoint, 120000, 60000); /* a response takes one forward per token */
    CHECK(c != NULL);
    if (c == NULL)
        return 1;
    char task[PPOZ_TASK_ID_CAP] = "";
    CHECK_RC(c, ppoz_attach(c, task, sizeof task), PPOZ_OK);
    const ppoz_sampling sampling = {.max_new_tokens = 8, .temperature = 1.0, .top_p = 0.9, .has_seed = 1, .seed = 7};
    char text[PPOZ_TEXT_CAP] = "";
    size_t text_len = 0;
    int n_tokens = -1, version = -1;
    const char *reason = NULL;
    CHECK_RC(c, ppoz_generate(c, task, "Q: 2 + 3 = ? Answer with a number.\nA:", NULL, NULL, 0, &sampling, 60000, text,
                              sizeof text, &text_len, &n_tokens, &reason, &version),
             PPOZ_OK);
    const ppoz_reply *r = ppoz_last_reply(c);
    CHECK(n_tokens >= 1 && n_tokens <= 8 && reason != NULL && version >= 0);
    CHECK(r != NULL && r->has_logprob && r->logprob <= 0.0 && !r->text_truncated && text_len == r->text_len);
    if (reason != NULL && r != NULL)
        printf("generated task %s n_tokens %d finish_reason %s policy_version %d text_len %zu logprob %.17g\n", task, n_tokens,
               reason, version, text_len, r->logprob);
    CHECK_RC(c, ppoz_feedback(c, task, 1.0, 1, 0), PPOZ_OK);
    CHECK(ppoz_last_reply(c)->segment_closed == 1);
    CHECK_RC(c, ppoz_detach(c, task), PPOZ_OK);
    ppoz_close(c);
    return 0;
}

static int attach_once(const char *endpoint, int deadline_ms, int attempt_ms)
{
    ppoz_client *c = ppoz_open(endpoint, deadline_ms, attempt_ms);
    if (c == NULL) {
        printf("error open: %s\n", strerror(errno));
        return 1;
    }
    char task[PPOZ_TASK_ID_CAP] = "";
    int rc = ppoz_attach(c, task, sizeof task);
    if (rc == PPOZ_OK)
        printf("attached %s attempts %lu\n", task, ppoz_attempts(c));
    else
        printf("error %s attempts %lu: %s\n", ppoz_error_code(c), ppoz_attempts(c), ppoz_error_message(c));
    ppoz_close(c);
    return rc == PPOZ_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 2 && strcmp(argv[1], "offline") == 0)
        offline();
    else if (argc == 3 && strcmp(argv[1], "live") == 0)
        live(argv[2]);
    else if (argc == 3 && strcmp(argv[1], "generate-live") == 0)
        generate_live(argv[2]);
    else if (argc == 5 && strcmp(argv[1], "attach") == 0)
        return attach_once(argv[2], atoi(argv[3]), atoi(argv[4]));
    else if (argc == 6 && strcmp(argv[1], "generate") == 0)
        return generate_once(argv[2], atoi(argv[3]), atoi(argv[4]), (size_t)strtoul(argv[5], NULL, 10));
    else {
        fprintf(stderr,
                "usage: %s offline | live ENDPOINT | generate-live ENDPOINT | attach ENDPOINT DEADLINE_MS ATTEMPT_TIMEOUT_MS"
                " | generate ENDPOINT DEADLINE_MS ATTEMPT_TIMEOUT_MS TEXT_CAP\n",
                argv[0]);
        return 2;
    }
    printf("test_client %s: %d/%d checks ok\n", argv[1], checks - failures, checks);
    return failures == 0 ? 0 : 1;
}
