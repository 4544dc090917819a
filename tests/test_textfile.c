/* The TinyStoriesV2-layout reader used by --ppl. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <string.h>

#include "textfile.h"
#include "testutil.h"

static void test_splits_and_strips(void **state) {
    const char *text = "  First story.\nSecond line.\n<|endoftext|>\n\nStory two.\n <|endoftext|> \n\n<|endoftext|>\nLast";
    StoryFile f;
    char err[128];
    assert_int_equal(storyfile_parse(&f, text, strlen(text), err, sizeof err), 0);
    assert_int_equal(f.n_stories, 3);
    assert_string_equal(f.stories[0], "First story.\nSecond line.");
    assert_string_equal(f.stories[1], "Story two.");
    assert_string_equal(f.stories[2], "Last");
    storyfile_free(&f);
}

static void test_separator_inside_a_line_is_text(void **state) {
    const char *text = "a <|endoftext|> b\n<|endoftext|>";
    StoryFile f;
    char err[128];
    assert_int_equal(storyfile_parse(&f, text, strlen(text), err, sizeof err), 0);
    assert_int_equal(f.n_stories, 1);
    assert_string_equal(f.stories[0], "a <|endoftext|> b");
    storyfile_free(&f);
}

static void test_rejects_bad_text(void **state) {
    StoryFile f;
    char err[128];
    const char bad_utf8[] = "ok story\n<|endoftext|>\nbad \xC3\x28 byte";
    assert_int_equal(storyfile_parse(&f, bad_utf8, sizeof bad_utf8 - 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "story 2"));
    /* utf8.h's rules: a surrogate and an overlong form are not text either */
    const char surrogate[] = "a story\n<|endoftext|>\nb\n<|endoftext|>\nc \xED\xA0\x80";
    assert_int_equal(storyfile_parse(&f, surrogate, sizeof surrogate - 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "story 3"));
    assert_int_equal(storyfile_parse(&f, "\xC0\xAF", 2, err, sizeof err), -1);
    const char nul[] = "a\0b";
    assert_int_equal(storyfile_parse(&f, nul, 3, err, sizeof err), -1);
    assert_int_equal(storyfile_parse(&f, "\n<|endoftext|>\n  \n", 18, err, sizeof err), -1);
    assert_non_null(strstr(err, "no story"));
    assert_int_equal(storyfile_read(&f, "/nonexistent/file.txt", err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open"));
}

int main(int argc, char **argv) {
    (void)argc; (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_splits_and_strips), cmocka_unit_test(test_separator_inside_a_line_is_text),
        cmocka_unit_test(test_rejects_bad_text),
    };
    return cmocka_run_group_tests_name("textfile", tests, NULL, NULL);
}
